"""Continuous batching on the tiny model: batched results equal alone results, one prefill for n > 1,
chunked prefills that let running streams move, limits respected.

Most tests step the batcher by hand (an engine built with ``start=False`` and ``prepare()``d), so
which requests share a step is deterministic.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from gyrfalcon.engine.transformers_engine import TransformersEngine
from gyrfalcon.plugins.engines import create_transformers_engine
from gyrfalcon.engine_api.types import EngineRequest, OutputKind, SamplingParams
from gyrfalcon.errors import RequestError
from gyrfalcon.plugins import plugin_manager
from gyrfalcon.validation import RequestValidator
from tests.conftest import tiny_settings

_ids = iter(range(10**9))
_rng = random.Random(7)
PROMPTS = [[1] + [_rng.randrange(3, 512) for _ in range(length - 1)] for length in (5, 9, 17, 9, 30, 3)]


def request(prompt, kind=OutputKind.FINAL_ONLY, **params) -> EngineRequest:
    return EngineRequest(f"batch-{next(_ids)}", list(prompt), SamplingParams(**params), kind)


@pytest.fixture
def stepped(tiny_model_dir):
    engines = []

    def make(**overrides) -> TransformersEngine:
        engine = create_transformers_engine(tiny_settings(tiny_model_dir, **overrides), start=False)
        assert engine.core.prepare()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown(0)


def run(engine, streams, submit_later=(), every=3, limit=5000):
    """Step until idle, submitting ``submit_later`` one by one every ``every`` steps; the max batch seen."""
    pending = list(submit_later)
    widest = steps = 0
    while True:
        if pending and steps % every == 0:
            streams.append(engine.submit(pending.pop(0)))
        worked = engine.core.batcher.step()
        widest = max(widest, engine.core.batcher.running_sequences)
        steps += 1
        assert steps < limit
        if not worked and not pending:
            return widest


def finals(streams):
    out = []
    for stream in streams:
        items = list(stream)
        assert len(items) == 1 and items[0].finished and items[0].error is None
        out.append([c.token_ids for c in items[0].outputs])
    return out


def alone(engine, requests):
    results = []
    for req in requests:
        streams = [engine.submit(req)]
        run(engine, streams)
        results.extend(finals(streams))
    return results


SAMPLING = [
    dict(temperature=0.0),
    dict(temperature=0.8, seed=11),
    dict(temperature=1.0, top_k=20, seed=12),
    dict(temperature=0.7, top_p=0.9, seed=13),
    dict(temperature=1.2, min_p=0.05, seed=14, n=3),
    dict(temperature=0.0),
]


def make_requests(max_tokens=(12, 20, 7, 25, 16, 9)):
    return [request(p, max_tokens=m, ignore_eos=True, **s) for p, m, s in zip(PROMPTS, max_tokens, SAMPLING)]


def test_greedy_and_seeded_results_are_the_same_alone_and_batched(stepped):
    engine = stepped()
    reference = alone(engine, make_requests())
    # everything submitted at once: equal-length prompts share a prefill, the rest merge in later
    streams = [engine.submit(r) for r in make_requests()]
    assert run(engine, streams) >= 6
    assert finals(streams) == reference
    # newcomers merged into a running batch every few steps, as traffic arrives
    streams = []
    assert run(engine, streams, submit_later=make_requests(), every=4) >= 4
    assert finals(streams) == reference


def test_threaded_engine_concurrent_requests_match_alone(tiny_engine):
    requests = make_requests()
    reference = [[c.token_ids for c in list(tiny_engine.submit(r))[-1].outputs] for r in requests]
    streams = [tiny_engine.submit(r) for r in make_requests()]
    assert finals(streams) == reference


def test_n_choices_share_one_prefill(stepped):
    engine = stepped()
    before = engine.stats()["prefill_forwards"]
    streams = [engine.submit(request(PROMPTS[4], n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True))]
    run(engine, streams)
    (choices,) = finals(streams)
    assert len(choices) == 4 and all(len(c) == 6 for c in choices)
    stats = engine.stats()
    assert stats["prefill_forwards"] - before == 1
    assert stats["prompt_tokens"] == len(PROMPTS[4])


def test_long_prompt_is_prefilled_in_chunks_while_the_batch_decodes(stepped):
    engine = stepped(enable_prefix_caching=False)  # the alone run must not leave cached blocks behind
    long_prompt = [1] + [_rng.randrange(3, 512) for _ in range(59)]
    (expected,) = alone(engine, [request(long_prompt, temperature=0.0, max_tokens=8, ignore_eos=True)])
    engine.core.scheduler.prefill_chunk_tokens = 8
    runner_stream = engine.submit(request(PROMPTS[0], temperature=0.0, max_tokens=60, ignore_eos=True,
                                          kind=OutputKind.DELTA))  # fmt: skip
    for _ in range(3):
        engine.core.batcher.step()
    before = engine.stats()["prefill_forwards"]
    long_stream = engine.submit(request(long_prompt, temperature=0.0, max_tokens=8, ignore_eos=True))
    running = engine.core.scheduler.running[0].sequences[0]
    progress = []
    while engine.core.batcher.prefilling_requests() or engine.stats()["prefill_forwards"] == before:
        tokens = len(running.token_ids)
        engine.core.batcher.step()
        progress.append(len(running.token_ids) - tokens)
    assert engine.stats()["prefill_forwards"] - before == 8  # ceil(60 / 8) chunks, each shared with a decode
    assert progress == [1] * 8  # the running stream got a token at every chunk
    streams = [long_stream]
    run(engine, streams)
    assert finals(streams) == [expected]
    assert sum(len(c.token_ids) for item in runner_stream for c in item.outputs) == 60


def test_max_num_seqs_bounds_the_batch(stepped):
    engine = stepped(max_num_seqs=3)
    streams = [engine.submit(request(PROMPTS[i % 3], temperature=0.0, max_tokens=5 + i, ignore_eos=True))
               for i in range(7)]  # fmt: skip
    assert run(engine, streams) == 3
    assert all(len(c[0]) == 5 + i for i, c in enumerate(finals(streams)))



def _prompt_logprobs_run(engine, prompt, chunk, others=()):
    """Prompt logprobs of ``prompt`` (asked) prefilled ``chunk`` tokens at a time, sharing forwards
    with ``others`` (not asking); the gathered positions after each prefill step."""
    engine.core.scheduler.prefill_chunk_tokens = chunk
    asks = dict(temperature=0.0, max_tokens=2, ignore_eos=True)
    streams = [engine.submit(request(prompt, prompt_logprobs=3, **asks))]
    streams += [engine.submit(request(p, **asks)) for p in others]
    gathered = []
    while engine.core.batcher.step():
        for state in engine.core.scheduler.running:
            if state.request_id == streams[0].request_id and not state.forked:
                assert not [v for v in vars(state).values() if isinstance(v, torch.Tensor)]  # no logits kept
                gathered.append((state.prompt_logprobs_done, {0: len(state.prompt_logprobs.token_ids)}))
    items = [list(s)[-1] for s in streams]
    assert all(item.error is None for item in items)
    assert all(item.prompt_logprobs is None for item in items[1:])  # only the row that asked
    return items[0], gathered


def test_prompt_logprobs_are_gathered_chunk_by_chunk_and_equal_the_whole_prompts(stepped):
    """Each chunk's positions are gathered at once, only for the rows that asked, and its logits
    dropped: a prefill no longer holds (and re-log-softmaxes) the whole prompt's ``[k, L, V]``."""
    engine = stepped()
    prompt = [1] + [_rng.randrange(3, 512) for _ in range(39)]
    whole, _ = _prompt_logprobs_run(engine, prompt, 512)
    chunked, gathered = _prompt_logprobs_run(engine, prompt, 8)
    assert gathered == [(done, {0: done + 1}) for done in range(8, 40, 8)]  # position 0 (None) + done
    others = [[1] + [_rng.randrange(3, 512) for _ in range(39)]]
    grouped, _ = _prompt_logprobs_run(engine, prompt, 80, others)  # one group of two, one forward
    for got in (chunked, grouped):
        expected = whole.prompt_logprobs
        assert len(got.prompt_logprobs.token_ids) == len(prompt) == len(expected.token_ids)
        assert got.prompt_logprobs.token_ids == prompt and got.prompt_logprobs.logprobs[0] is None
        assert got.prompt_logprobs.top_token_ids == expected.top_token_ids
        assert got.prompt_logprobs.logprobs[1:] == pytest.approx(expected.logprobs[1:], abs=1e-4)
        assert got.outputs[0].token_ids == whole.outputs[0].token_ids


def test_priority_policy_runs_the_lowest_priority_value_first(stepped):
    engine = stepped(scheduling_policy="priority", max_num_seqs=1)
    assert "priority" in engine.info().capabilities
    order = []
    made = {name: dataclasses.replace(request(PROMPTS[0], max_tokens=3, ignore_eos=True), priority=priority)
            for name, priority in (("late", 7), ("normal", 0), ("urgent", -2))}  # fmt: skip
    streams = [engine.submit(r) for r in made.values()]
    names = {r.request_id: name for name, r in made.items()}
    steps = 0
    while len(order) < 3:  # one sequence at a time: each request runs alone, in priority order
        engine.core.batcher.step()
        steps += 1
        assert steps < 100
        order.extend(names[s.request_id] for s in engine.core.scheduler.running if names[s.request_id] not in order)
    assert order == ["urgent", "normal", "late"]
    run(engine, [])
    assert all(len(tokens[0]) == 3 for tokens in finals(streams))


def test_fcfs_engine_refuses_a_non_zero_priority(stepped):
    validator = RequestValidator.of(plugin_manager(), stepped().info())
    with pytest.raises(RequestError, match="scheduling-policy priority"):
        validator.check(dataclasses.replace(request(PROMPTS[0], max_tokens=2), priority=1))
