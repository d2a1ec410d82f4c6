"""Sampling processors against per-row references, and the token chooser."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gyrfalcon.engine.sample import persistent_batch
from gyrfalcon.engine.sample.sampler import Sampler
from gyrfalcon.engine.sample.logprob_reports import LOGPROB_FLOOR
from gyrfalcon.engine_api.config import LOGPROBS_MODES
from gyrfalcon.engine_api.types import EngineInfo, EngineRequest, SamplingParams
from gyrfalcon.errors import Kind, RequestError
from gyrfalcon.validation import RequestValidator
from gyrfalcon.policies.sampling import (
    MinPProcessor,
    TemperatureProcessor,
    TopKProcessor,
    TopPProcessor,
    processors as sampling_processors,
)
from gyrfalcon.policies import BatchRows, LogprobGatherer
from gyrfalcon.policies.logprobs import gatherers
from gyrfalcon.api.errors import http_status

V = 16
INFO = EngineInfo("m", V, 64, [2], 20, 8, frozenset())


def rows_for(params: list[SamplingParams], policies=(), *, outputs=None, extensions=None, seeds=None) -> BatchRows:
    """The rows as the engine builds them: joined to a persistent batch of ``policies`` (a
    sampler's processors and gatherers, or single processors)."""
    if isinstance(policies, Sampler):
        policies = [*policies.processors, *policies.gatherers]
    return persistent_batch.rows_for(list(policies), V, params, [[1, 2]] * len(params), outputs, extensions, seeds)


def known_logits(rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(rows, V, generator=gen) * 3


def apply(processor, logits, params):
    rows = rows_for(params, [processor])
    selected = rows.selected.get(id(processor), [])
    assert selected == [i for i, p in enumerate(params) if processor.wants(p, {})]
    return processor(logits.clone(), rows, selected), selected


# per-row references, written the obvious (slow) way
def ref_top_k(row: torch.Tensor, k: int) -> torch.Tensor:
    kth = sorted(row.tolist(), reverse=True)[k - 1]
    return torch.where(row >= kth, row, torch.tensor(-math.inf))


def ref_top_p(row: torch.Tensor, p: float) -> torch.Tensor:
    probs = row.softmax(-1).tolist()
    order = sorted(range(V), key=lambda i: -probs[i])
    keep, total = set(), 0.0
    for i in order:
        keep.add(i)
        total += probs[i]
        if total >= p:
            break
    return torch.tensor([row[i].item() if i in keep else -math.inf for i in range(V)])


def ref_min_p(row: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = row.softmax(-1)
    return torch.where(probs >= probs.max() * min_p, row, torch.tensor(-math.inf))


def test_temperature_touches_only_asking_rows():
    params = [SamplingParams(temperature=0.5), SamplingParams(), SamplingParams(temperature=0.0),
              SamplingParams(temperature=2.0)]  # fmt: skip
    logits = known_logits(4)
    out, selected = apply(TemperatureProcessor(), logits, params)
    assert selected == [0, 3]
    torch.testing.assert_close(out[0], logits[0] / 0.5)
    torch.testing.assert_close(out[3], logits[3] / 2.0)
    assert torch.equal(out[1], logits[1]) and torch.equal(out[2], logits[2])


def test_top_k_matches_reference_per_row():
    params = [SamplingParams(top_k=3), SamplingParams(), SamplingParams(top_k=1), SamplingParams(top_k=V)]
    logits = known_logits(4)
    out, selected = apply(TopKProcessor(V), logits, params)
    assert selected == [0, 2]  # top_k=-1 and top_k >= vocab ask for nothing
    assert torch.equal(out[0], ref_top_k(logits[0], 3))
    assert torch.equal(out[2], ref_top_k(logits[2], 1))
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])


@pytest.mark.parametrize("p", [0.05, 0.3, 0.75, 0.99])
def test_top_p_matches_reference_per_row(p):
    params = [SamplingParams(top_p=p), SamplingParams(), SamplingParams(top_p=0.5)]
    logits = known_logits(3)
    out, selected = apply(TopPProcessor(), logits, params)
    assert selected == [0, 2]
    assert torch.equal(torch.isinf(out[0]), torch.isinf(ref_top_p(logits[0], p)))
    assert torch.equal(torch.isinf(out[2]), torch.isinf(ref_top_p(logits[2], 0.5)))
    assert torch.equal(out[1], logits[1])
    kept = ~torch.isinf(out[0])
    assert torch.equal(out[0][kept], logits[0][kept])


def test_min_p_matches_reference_per_row():
    params = [SamplingParams(min_p=0.1), SamplingParams(min_p=0.0), SamplingParams(min_p=0.5)]
    logits = known_logits(3)
    out, selected = apply(MinPProcessor(), logits, params)
    assert selected == [0, 2]
    assert torch.equal(out[0], ref_min_p(logits[0], 0.1))
    assert torch.equal(out[2], ref_min_p(logits[2], 0.5))
    assert torch.equal(out[1], logits[1])


def test_greedy_rows_are_not_touched_by_truncation():
    params = [SamplingParams(temperature=0.0, top_k=2, top_p=0.5, min_p=0.3)]
    for processor in sampling_processors(INFO):
        assert not processor.wants(params[0], {})


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(temperature=math.nan), "temperature"),
    ],
)
def test_processors_validate(params, param):
    """Their ranges are the documents' (decided on the wire, or by the validator for an engine
    request built without the API)."""
    info = dataclasses.replace(INFO, capabilities=INFO.capabilities | params.asked_fields())
    with pytest.raises(RequestError) as err:
        RequestValidator(info, sampling_processors(INFO)).check(EngineRequest("r", [1], params))
    assert err.value.param == param and err.value.type == Kind.INVALID


def make_sampler(gatherers=(), seed=0) -> Sampler:
    return Sampler(sampling_processors(INFO), list(gatherers), [2], torch.Generator().manual_seed(seed))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax():
    logits = known_logits(3)
    params = [SamplingParams(temperature=0.0)] * 3
    sampler = make_sampler()
    out = sampler.sample(logits.clone(), rows_for(params, sampler))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None, None, None]


def test_seeded_rows_are_reproducible_and_independent_of_company():
    """A row's draw is a function of (its seed, its position): the same alone, in any company,
    and on every repeat; successive positions draw different numbers."""
    logits = known_logits(4)
    me = SamplingParams(temperature=0.9, top_k=8, seed=7)
    alone = []
    for position in range(6):
        sampler = make_sampler()
        alone.append(sampler.sample(logits[1:2].clone(), rows_for([me], sampler, outputs=[[0] * position], seeds=[7])).token_ids[0])
    company = [SamplingParams(temperature=1.3), me, SamplingParams(temperature=0.0), SamplingParams(top_p=0.4, seed=3)]
    together = []
    sampler = make_sampler(seed=99)
    for position in range(6):
        outputs = [[0] * position for _ in company]
        rows = rows_for(company, sampler, outputs=outputs, seeds=[11, 7, 12, 3])
        together.append(sampler.sample(logits.clone(), rows).token_ids[1])
    assert alone == together
    assert len(set(alone)) > 1  # it really samples


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (V - 3))
    logits = probs.log().unsqueeze(0)
    sampler = make_sampler()
    counts = torch.zeros(V)
    trials = 3000
    for seed in range(trials):
        counts[sampler.sample(logits.clone(), rows_for([SamplingParams()], sampler, seeds=[seed])).token_ids[0]] += 1
    freq = counts / trials
    assert torch.allclose(freq[:3], probs[:3], atol=0.04)
    assert counts[3:].sum() == 0


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(3, V)
    logits[:, 2] = 100.0  # eos
    logits[:, 5] = 50.0  # a stop token id
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=1),
    ]
    sampler = make_sampler()
    rows = rows_for(params, sampler, outputs=[[9], [9], [9]])  # one token generated so far
    out = sampler.sample(logits.clone(), rows)
    # row 0: eos and 5 masked; row 1: eos not masked under ignore_eos (vLLM); row 2: min_tokens reached
    assert out.token_ids[0] not in (2, 5)
    assert out.token_ids[1] == 2
    assert out.token_ids[2] == 2


class RecordingGatherer(LogprobGatherer):
    """Reports the two top raw logprobs of rows whose extensions ask for it."""

    name = "recording"
    fields = frozenset({"test_logprobs"})

    def __init__(self):
        self.calls = []

    def wants(self, params, extensions):
        return bool(extensions.get("test_logprobs"))

    def gather(self, logprobs, sampled, rows, selected):
        self.calls.append((logprobs.clone(), sampled.clone(), list(selected)))
        out = [None] * len(rows)
        for i in selected:
            top = logprobs[i].topk(2)
            out[i] = (top.indices.tolist(), top.values.tolist())
        return out


def test_logprob_hook_point_gets_raw_log_softmax_and_sampled_ids():
    gatherer = RecordingGatherer()
    sampler = make_sampler([gatherer])
    logits = known_logits(2)
    rows = rows_for([SamplingParams(temperature=0.5, top_k=2), SamplingParams(temperature=0.0)], sampler,
                    extensions=[{"test_logprobs": True}, {}])  # fmt: skip
    out = sampler.sample(logits.clone(), rows)
    (raw, sampled, selected), = gatherer.calls
    torch.testing.assert_close(raw, logits.log_softmax(-1))  # before temperature and top-k
    assert sampled.tolist() == out.token_ids and selected == [0]
    report = out.logprobs[0]
    assert report.token_ids == [out.token_ids[0]]
    assert report.logprobs[0] == pytest.approx(raw[0, out.token_ids[0]].item())
    assert report.top_token_ids[0] == raw[0].topk(2).indices.tolist()
    assert out.logprobs[1] is None


def test_no_gatherer_wanting_means_no_log_softmax():
    gatherer = RecordingGatherer()
    sampler = make_sampler([gatherer])
    out = sampler.sample(known_logits(2), rows_for([SamplingParams()] * 2, sampler))
    assert gatherer.calls == [] and out.logprobs == [None, None]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_rows_with_no_token_left_get_an_error_not_a_token(temperature):
    """A fully masked row used to give argmax 0 (greedy) or a draw from NaN probabilities."""
    logits = known_logits(4)
    logits[1, :] = -math.inf  # e.g. masked by a plugin processor
    logits[3, 4] = math.nan  # e.g. an overflow in the model or a processor
    params = [
        SamplingParams(temperature=temperature, seed=1),
        SamplingParams(temperature=temperature, seed=2),
        SamplingParams(temperature=temperature, seed=3, allowed_token_ids=[2], min_tokens=2),
        SamplingParams(temperature=temperature, seed=4),
    ]
    from gyrfalcon.policies import penalties

    processors = sampling_processors(INFO) + penalties.processors(INFO)
    sampler = Sampler(processors, [], [2], seeded(0))
    out = sampler.sample(logits.clone(), rows_for(params, sampler, seeds=[1, 2, 3, 4]))
    assert sorted(out.errors) == [1, 2, 3]
    # row 1: nothing named the cause; row 2: allowed_token_ids = [eos] while min_tokens bans eos
    assert (http_status(out.errors[1]), out.errors[1].type, out.errors[1].param) == (400, "invalid_request_error", None)
    assert (http_status(out.errors[2]), out.errors[2].param) == (400, "allowed_token_ids")
    message = out.errors[2].message
    assert "every token is excluded by the request's constraints (allowed_token_ids, min_tokens)" in message
    assert http_status(out.errors[3]) == 500 and "NaN" in out.errors[3].message
    # the healthy row samples as it would alone
    lone = make_sampler()
    alone = lone.sample(logits[:1].clone(), rows_for(params[:1], lone, seeds=[1]))
    assert out.token_ids[0] == alone.token_ids[0] and alone.errors == {}


def _processed_by_hand(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """A row's logits as the sampler draws from them, by the references above: temperature, top-k, top-p."""
    if params.greedy:
        return row
    row = row / params.temperature
    if params.top_k > 0:
        row = ref_top_k(row, params.top_k)
    if params.top_p < 1.0:
        row = ref_top_p(row, params.top_p)
    return row


@pytest.mark.parametrize("mode", list(LOGPROBS_MODES))
def test_each_logprobs_mode_reports_what_it_names(mode):
    """Every logprob a row reports (the sampled token's and the top ones) is the mode's value: the
    raw or processed logits, or their log-softmax; processed = after temperature, top-k and top-p,
    what the token is drawn from (a token they exclude reports the floor)."""
    params = [SamplingParams(temperature=0.7, top_k=5, logprobs=4, seed=1), SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=1.3, top_p=0.6, logprobs=2, seed=2)]  # fmt: skip
    sampler = Sampler(sampling_processors(INFO), gatherers(INFO), [2], seeded(0), logprobs_mode=mode)
    logits = known_logits(3)
    out = sampler.sample(logits.clone(), rows_for(params, sampler, seeds=[1, 0, 2]))
    for i, p in enumerate(params):
        values = _processed_by_hand(logits[i], p) if mode.startswith("processed") else logits[i]
        if mode.endswith("_logprobs"):
            values = values.log_softmax(-1)
        values = values.clamp_min(LOGPROB_FLOOR)
        report = out.logprobs[i]
        assert report.token_ids == [out.token_ids[i]]
        assert report.logprobs[0] == pytest.approx(values[out.token_ids[i]].item(), abs=1e-5), (mode, i)
        top = values.topk(p.logprobs)
        assert report.top_token_ids[0] == top.indices.tolist(), (mode, i)
        assert report.top_logprobs[0] == pytest.approx(top.values.tolist(), abs=1e-5), (mode, i)


def test_processed_logprobs_are_the_probabilities_the_tokens_are_drawn_with():
    """Under ``processed_logprobs`` a sampled token's logprob is the log of the probability the
    sampler drew it with: over many seeds each token comes up that often, and the tokens top-k
    leaves hold all the probability."""
    params = SamplingParams(temperature=0.8, top_k=4, logprobs=4)
    sampler = Sampler(sampling_processors(INFO), gatherers(INFO), [2], seeded(0), logprobs_mode="processed_logprobs")
    logits = known_logits(1)
    counts, reported, trials = torch.zeros(V), {}, 3000
    for seed in range(trials):
        out = sampler.sample(logits.clone(), rows_for([params], sampler, seeds=[seed]))
        token, report = out.token_ids[0], out.logprobs[0]
        counts[token] += 1
        reported[token] = report.logprobs[0]
        assert math.fsum(math.exp(v) for v in report.top_logprobs[0]) == pytest.approx(1.0, abs=1e-5)
    assert len(reported) == 4
    for token, logprob in reported.items():
        assert counts[token].item() / trials == pytest.approx(math.exp(logprob), abs=0.03), token
