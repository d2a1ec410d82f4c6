"""The built-in logprob gatherers on known logits, the merge rules and the prompt-logprob path."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gyrfalcon.engine.sample import persistent_batch
from gyrfalcon.engine.sample.logprob_reports import merge_gathered
from gyrfalcon.engine.sample.prompt_logprobs import compute_prompt_logprobs
from gyrfalcon.engine.sample.sampler import Sampler
from gyrfalcon.engine_api.types import LOGPROB_FLOOR, EngineInfo, EngineRequest, SamplingParams
from gyrfalcon.errors import Kind, RequestError
from gyrfalcon.policies.logprobs import (
    PromptLogprobsGatherer,
    TokenIdsLogprobGatherer,
    TopLogprobsGatherer,
    gatherers as builtin_gatherers,
)
from gyrfalcon.policies import BatchRows
from gyrfalcon.validation import RequestValidator

V = 8
INFO = EngineInfo("m", vocab_size=V, max_model_len=64, eos_token_ids=[2], max_logprobs=5, max_num_seqs=4,
                  capabilities=frozenset())  # fmt: skip


def rows_of(*params: SamplingParams, policies=()) -> BatchRows:
    """Rows joined to a persistent batch of ``policies``, as the engine builds them."""
    return persistent_batch.rows_for(list(policies), V, list(params))


def known_logprobs() -> torch.Tensor:
    """Three rows with distinct, known orderings (row 2 has a -inf entry)."""
    logits = torch.tensor(
        [
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],  # ascending: top is 7, 6, 5, ...
            [7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0],  # descending: top is 0, 1, 2, ...
            [0.0, 9.0, -math.inf, 1.0, 2.0, 3.0, 4.0, 5.0],
        ]
    )
    return logits.log_softmax(dim=-1)


def gatherers():
    return [TopLogprobsGatherer(), TokenIdsLogprobGatherer()]


def merged(params: list[SamplingParams], sampled: list[int]):
    lp = known_logprobs()[: len(params)]
    gs = gatherers()
    rows = rows_of(*params, policies=gs)
    selected = [rows.selected.get(id(g), []) for g in gs]
    assert selected == [[i for i, p in enumerate(params) if g.wants(p, {})] for g in gs]
    return lp, merge_gathered(gs, lp, torch.tensor(sampled), rows, selected)


def test_top_k_per_row_in_one_batch():
    params = [SamplingParams(logprobs=3), SamplingParams(logprobs=1), SamplingParams(logprobs=0)]
    lp, reports = merged(params, [0, 4, 1])
    assert reports[0].token_ids == [0] and reports[0].top_token_ids == [[7, 6, 5]]
    assert reports[1].token_ids == [4] and reports[1].top_token_ids == [[0]]
    assert reports[2].token_ids == [1] and reports[2].top_token_ids == [[]]  # logprobs 0: the sampled token only
    for i, report in enumerate(reports):
        assert report.logprobs[0] == pytest.approx(float(lp[i, report.token_ids[0]]))
        for token_id, value in zip(report.top_token_ids[0], report.top_logprobs[0]):
            assert value == pytest.approx(float(lp[i, token_id]))


def test_rows_without_logprobs_get_no_report():
    _, reports = merged([SamplingParams(), SamplingParams(logprobs=2)], [3, 3])
    assert reports[0] is None and reports[1].top_token_ids == [[0, 1]]


def test_explicit_ids_are_the_sampled_token_plus_exactly_the_ids_superseding_top_k():
    params = [SamplingParams(logprobs=5, logprob_token_ids=[0, 3]), SamplingParams(logprobs=1, logprob_token_ids=[1, 4, 5])]
    lp, reports = merged(params, [3, 6])
    # row 0: the sampled token 3 is also requested: listed once
    assert reports[0].token_ids == [3] and reports[0].top_token_ids == [[3, 0]]
    assert reports[1].token_ids == [6] and reports[1].top_token_ids == [[6, 1, 4, 5]]  # no top-1 (token 0)
    for i, report in enumerate(reports):
        for token_id, value in zip(report.top_token_ids[0], report.top_logprobs[0]):
            assert value == pytest.approx(float(lp[i, token_id]))


def test_values_are_finite():
    params = [SamplingParams(), SamplingParams(), SamplingParams(logprobs=0, logprob_token_ids=[2])]
    _, reports = merged(params, [0, 0, 2])
    report = reports[2]
    assert report.logprobs == [LOGPROB_FLOOR] and report.top_logprobs == [[LOGPROB_FLOOR]]
    assert all(math.isfinite(v) for v in report.top_logprobs[0])


def test_whole_vocabulary_count_when_uncapped():
    lp = known_logprobs()[:1]
    gatherer = TopLogprobsGatherer()
    rows = rows_of(SamplingParams(logprobs=-1), policies=[gatherer])
    gathered = gatherer.gather(lp, torch.tensor([0]), rows, [0])
    assert gathered.rows == [0] and gathered.widths == [V]
    assert gathered.ids[0].tolist() == [7, 6, 5, 4, 3, 2, 1, 0]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(logprobs=6), "logprobs"),
        (SamplingParams(logprobs=-1), "logprobs"),
        (SamplingParams(logprobs=-2), "logprobs"),
        (SamplingParams(prompt_logprobs=6), "prompt_logprobs"),
        (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
        (SamplingParams(logprobs=1, logprob_token_ids=[]), "logprob_token_ids"),
        (SamplingParams(logprobs=1, logprob_token_ids=[1, 1]), "logprob_token_ids"),
        (SamplingParams(logprobs=1, logprob_token_ids=[V]), "logprob_token_ids"),
        (SamplingParams(logprobs=1, logprob_token_ids=[-1]), "logprob_token_ids"),
        (SamplingParams(logprobs=1, logprob_token_ids=list(range(129))), "logprob_token_ids"),
    ],
)
def test_validation(params, param):
    """An engine request built without the API has its counts and ids bounded by the validator (the
    documents' sizes, the deployment's max_logprobs and vocabulary); one that came through the API
    had them decided on the wire, and the validator does not decide them again."""
    info = INFO if param != "logprob_token_ids" or len(params.logprob_token_ids or []) < 129 else _big_vocab()
    info = dataclasses.replace(info, capabilities=frozenset(g.name for g in builtin_gatherers(info)) | {"logprobs"})
    validator = RequestValidator(info, gatherers=builtin_gatherers(info))
    request = EngineRequest(request_id="r", prompt_token_ids=[1], sampling=params)
    with pytest.raises(RequestError) as err:
        validator.check(request)
    assert err.value.param == param and err.value.type == Kind.INVALID
    validator.check(request, bounds_decided=True)


def test_ids_without_a_count_are_served_by_the_engine():
    """"logprob_token_ids requires logprobs" is the wire's rule, stated once in the documents (each
    endpoint asks for logprobs its own way); an engine request that names ids without a count gets
    exactly those ids' logprobs (the gatherer no longer refuses it a second time)."""
    params = SamplingParams(logprob_token_ids=[1])
    for gatherer in builtin_gatherers(INFO):
        gatherer.validate(params, {}, INFO)
    wanted = [g.name for g in builtin_gatherers(INFO) if g.wants(params, {})]
    assert wanted == ["logprob_token_ids"]


def _big_vocab() -> EngineInfo:
    import dataclasses

    return dataclasses.replace(INFO, vocab_size=1000)


def test_minus_one_is_the_whole_vocabulary_only_on_an_uncapped_server():
    import dataclasses

    uncapped = dataclasses.replace(INFO, max_logprobs=-1)
    for gatherer in builtin_gatherers(uncapped):
        gatherer.validate(SamplingParams(logprobs=-1, prompt_logprobs=-1), {}, uncapped)
        gatherer.validate(SamplingParams(logprobs=5, logprob_token_ids=list(range(V))), {}, uncapped)


def test_prompt_logprobs_from_prefill_logits():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(1))
    prompt = [3, 1, 4, 1, 5]
    request = EngineRequest("r", prompt, SamplingParams(prompt_logprobs=2))
    result = compute_prompt_logprobs(logits, request, [PromptLogprobsGatherer()])
    lp = logits.log_softmax(dim=-1)
    assert result.token_ids == prompt
    assert result.logprobs[0] is None and result.top_token_ids[0] == []
    for p in range(1, 5):
        assert result.logprobs[p] == pytest.approx(float(lp[p - 1, prompt[p]]))
        top = lp[p - 1].topk(2)
        assert result.top_token_ids[p] == top.indices.tolist()
        assert result.top_logprobs[p] == pytest.approx(top.values.tolist())


def test_prompt_logprobs_zero_and_single_token_prompt():
    logits = torch.randn(3, V)
    request = EngineRequest("r", [1, 2, 3], SamplingParams(prompt_logprobs=0))
    result = compute_prompt_logprobs(logits, request, [PromptLogprobsGatherer()])
    assert result.top_token_ids == [[], [], []] and result.logprobs[0] is None and len(result.logprobs) == 3
    one = compute_prompt_logprobs(logits[:1], EngineRequest("r", [7], SamplingParams(prompt_logprobs=3)), [])
    assert (one.token_ids, one.logprobs) == ([7], [None])


def test_sampler_splits_prompt_and_generated_gatherers_and_reports_once_per_step():
    gs = builtin_gatherers(INFO)
    sampler = Sampler([], gs, [2], torch.Generator().manual_seed(0))
    assert [g.name for g in sampler.gatherers] == ["top_logprobs", "logprob_token_ids"]
    assert [g.name for g in sampler.prompt_gatherers] == ["prompt_logprobs"]
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]] * 2)
    rows = rows_of(SamplingParams(temperature=0.0, logprobs=2, prompt_logprobs=1), SamplingParams(temperature=0.0),
                   policies=sampler.gatherers)  # fmt: skip
    out = sampler.sample(logits.clone(), rows)
    assert out.token_ids == [7, 7]
    assert out.logprobs[0].token_ids == [7] and out.logprobs[0].top_token_ids == [[7, 6]]
    assert out.logprobs[1] is None
