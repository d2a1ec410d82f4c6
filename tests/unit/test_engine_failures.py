"""A fault fails only the request it comes from, in-band, and the loop keeps serving: a forward
shared by several requests that raises is run again request by request, and a sampling fault is
retried the same way, so the requests that do not fault on their own go on with the tokens they
would have had alone."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gyrfalcon.engine_api.errors import ShuttingDown

from gyrfalcon.policies import LogitsProcessor
from gyrfalcon.plugins.engines import create_transformers_engine
from gyrfalcon.api.errors import http_status
from tests.conftest import tiny_settings
from tests.unit.test_batching import PROMPTS, alone, finals, request, run, stepped  # noqa: F401 - fixture


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(tiny_model_dir):
    engine = create_transformers_engine(tiny_settings(tiny_model_dir))
    try:
        assert engine.wait_ready(60).ready
        forward = engine.core.runner.step

        def flaky(works):  # the victim's third decode position (PROMPTS[0] has 5 tokens)
            if any(w.start == 7 for w in works):
                raise RuntimeError("boom")
            return forward(works)

        engine.core.runner.step = flaky
        (last,) = list(engine.submit(request(PROMPTS[0], n=2, temperature=1.0, max_tokens=10, ignore_eos=True)))
        assert last.finished and last.error is not None and "boom" in last.error.message
        assert engine.stats()["requests_failed"] == 1 and not engine.core._live
        (ok,) = list(engine.submit(request(PROMPTS[1], temperature=0.0, max_tokens=5, ignore_eos=True)))
        assert ok.error is None and len(ok.outputs[0].token_ids) == 5
    finally:
        engine.shutdown(0)


def test_steps_that_keep_failing_turn_health_unhealthy_until_one_succeeds(tiny_model_dir):
    """Three steps in a row that fail for the server's sake (nothing computed) make health say so
    (a 503 at /health); a step that computes
    tokens makes the engine healthy again."""
    engine = create_transformers_engine(tiny_settings(tiny_model_dir))
    try:
        assert engine.wait_ready(60).ready
        forward = engine.core.runner.step
        broken = [True]

        def failing(works):
            if broken[0]:
                raise RuntimeError("device lost")
            return forward(works)

        engine.core.runner.step = failing
        for i in range(3):
            assert engine.health().ready, i
            (last,) = list(engine.submit(request(PROMPTS[0], max_tokens=3)))
            assert last.error is not None and "device lost" in last.error.message
        deadline = time.monotonic() + 5  # the stream ends inside the step; the step is counted as it ends
        while engine.health().ready and time.monotonic() < deadline:
            time.sleep(0.01)
        health = engine.health()
        assert not health.ready and "the last 3 steps failed" in health.message and "device lost" in health.message
        broken[0] = False
        (ok,) = list(engine.submit(request(PROMPTS[1], temperature=0.0, max_tokens=3, ignore_eos=True)))
        assert ok.error is None and engine.health().ready
    finally:
        engine.shutdown(0)


class LoopKilled(BaseException):
    """Something the step loop's own handler does not catch."""


def test_a_dead_step_loop_turns_health_503_fails_live_requests_and_refuses_new_ones(tiny_model_dir):
    engine = create_transformers_engine(tiny_settings(tiny_model_dir))
    try:
        assert engine.wait_ready(60).ready
        step = engine.core.batcher.step
        calls = []

        def dying():
            calls.append(1)
            if len(calls) > 2:  # the request is running by then
                raise LoopKilled("gone")
            return step()

        stream = engine.submit(request(PROMPTS[0], temperature=0.0, max_tokens=50, ignore_eos=True))
        engine.core.batcher.step = dying
        last = list(stream)[-1]  # never a hang: the live request ends with an error
        assert last.finished and last.error is not None and "engine stopped" in last.error.message
        engine.core._thread.join(5)
        health = engine.health()
        assert not health.ready and "LoopKilled" in health.message
        with pytest.raises(ShuttingDown):
            engine.submit(request(PROMPTS[1], max_tokens=2))
    finally:
        engine.shutdown(0)


# ---------------------------------------------------------------- faults next to a decoding request
# A stepped engine (tests/unit/test_batching.py): each step is deterministic and the running
# request's tokens can be compared with its alone run.


def _one_error(stream):
    items = list(stream)
    assert items and items[-1].finished and items[-1].error is not None
    return items[-1]


def _decoding(engine):
    """A greedy request already decoding (its result alone first, for comparison)."""
    req = dict(temperature=0.0, max_tokens=30, ignore_eos=True)
    (expected,) = alone(engine, [request(PROMPTS[0], **req)])
    stream = engine.submit(request(PROMPTS[0], **req))
    for _ in range(3):
        engine.core.batcher.step()
    assert engine.core.batcher.running_sequences == 1 and engine.core.batcher.prefilling_requests() == 0
    return stream, expected


def _assert_engine_goes_on(engine, running, expected, failed):
    run(engine, [])
    assert finals([running]) == [expected]
    assert failed.request_id not in engine.core._live and engine.core._live == {}
    assert engine.stats()["requests_failed"] == 1
    streams = [engine.submit(request(PROMPTS[1], temperature=0.0, max_tokens=5, ignore_eos=True))]
    run(engine, streams)
    assert [len(c) for c in finals(streams)[0]] == [5]


def test_a_fault_sampling_the_first_token_fails_that_request_only(stepped):
    """The victim's first token is sampled in the same batch as the running request's next one:
    the batch raises, the retry request by request raises for the victim only."""
    engine = stepped()
    running, expected = _decoding(engine)
    sample = engine.core.sampler.sample
    calls = {"first_token": 0}

    def flaky(logits, rows, *heads):
        if any(p == PROMPTS[2] and not out for p, out in zip(rows.prompt_token_ids, rows.output_token_ids)):
            calls["first_token"] += 1
            raise RuntimeError("processor exploded")
        return sample(logits, rows, *heads)

    engine.core.sampler.sample = flaky
    victim = engine.submit(request(PROMPTS[2], n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    engine.core.batcher.step()  # the running request's decode and the victim's prefill share the step
    assert calls["first_token"] == 2 and engine.core.batcher.prefilling_requests() == 0
    last = _one_error(victim)
    assert "processor exploded" in last.error.message and http_status(last.error) == 500
    assert [c.finish_reason for c in last.outputs] == ["abort", "abort"]
    assert engine.core.batcher.running_sequences == 1  # the decoding request is still there
    _assert_engine_goes_on(engine, running, expected, victim)


class FailsToJoin(LogitsProcessor):
    """A plugin processor whose per-row set-up raises for the rows that want it."""

    name = "fails_to_join"
    order = 1

    def wants(self, params, extensions):
        return params.temperature == 0.9

    def add_row(self, slot, row):
        raise RuntimeError("add_row exploded")

    def __call__(self, logits, rows, selected):
        return logits


def test_a_processor_that_cannot_take_a_row_fails_that_request_only(stepped):
    """The row is never sampled half set up (it would have been drawn without its processors)."""
    engine = stepped()
    running, expected = _decoding(engine)
    broken = FailsToJoin()
    engine.core.sampler.processors.insert(0, broken)
    engine.core.batcher.batch.policies.insert(0, broken)
    victim = engine.submit(request(PROMPTS[2], temperature=0.9, seed=3, max_tokens=8, ignore_eos=True))
    engine.core.batcher.step()
    last = _one_error(victim)
    assert "add_row exploded" in last.error.message and http_status(last.error) == 500
    assert len(engine.core.batcher.batch) == 1  # only the decoding request holds a slot
    _assert_engine_goes_on(engine, running, expected, victim)


def test_a_fault_gathering_prompt_logprobs_fails_the_group_only(stepped):
    engine = stepped()
    running, expected = _decoding(engine)
    gather = engine.core.sampler.gather_prompt_logprobs
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("gather failed")
        return gather(*args, **kwargs)

    engine.core.sampler.gather_prompt_logprobs = flaky
    victim = engine.submit(request(PROMPTS[2], temperature=0.0, max_tokens=4, prompt_logprobs=2))
    engine.core.batcher.step()
    assert "gather failed" in _one_error(victim).error.message
    _assert_engine_goes_on(engine, running, expected, victim)


def test_an_oom_in_a_shared_forward_fails_only_the_request_that_needs_the_memory(stepped):
    """The shared forward runs out of memory; run apart, the decoding request's part fits and the
    victim's (its whole prompt) does not: the victim fails, the batch keeps its tokens."""
    engine = stepped()
    running, expected = _decoding(engine)
    forward = engine.core.runner.step
    calls = {"n": 0}

    def flaky(works):
        if any(w.tokens == PROMPTS[2] for w in works):
            calls["n"] += 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return forward(works)

    engine.core.runner.step = flaky
    victim = engine.submit(request(PROMPTS[2], temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.core.batcher.step()
    assert calls["n"] == 2 and "out of memory" in _one_error(victim).error.message
    assert engine.core.batcher.running_sequences == 1
    free = engine.stats()["kv_blocks_free"]
    _assert_engine_goes_on(engine, running, expected, victim)
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"] >= free  # nothing leaked


def test_a_failed_prefill_chunk_spares_the_running_batch(stepped):
    """A fault in a chunk of a long prompt fails that request only; the decoding request's tokens
    are those of its alone run and a waiting request runs next."""
    engine = stepped()
    running, expected = _decoding(engine)
    engine.core.scheduler.prefill_chunk_tokens = 8
    forward = engine.core.runner.step
    calls = {"prefill": 0}

    def flaky(works):
        if any(w.start == 8 and len(w.tokens) > 1 for w in works):  # the victim's second chunk
            calls["prefill"] += 1
            raise RuntimeError("prefill forward failed")
        return forward(works)

    engine.core.runner.step = flaky
    victim = engine.submit(request(PROMPTS[4], temperature=0.0, max_tokens=8))  # 30 tokens: 4 chunks
    waiting = engine.submit(request(PROMPTS[1], temperature=0.0, max_tokens=5, ignore_eos=True))
    engine.core.batcher.step()
    assert engine.core.batcher.prefilling_requests() >= 1
    engine.core.batcher.step()  # its second chunk raises
    assert calls["prefill"] == 2
    assert "prefill forward failed" in _one_error(victim).error.message
    run(engine, [])
    assert finals([running]) == [expected]
    assert [len(c) for c in finals([waiting])[0]] == [5]
    assert engine.stats()["requests_failed"] == 1 and not engine.core._live


def test_the_threaded_loop_survives_a_prefill_fault_while_another_request_decodes(tiny_model_dir):
    engine = create_transformers_engine(tiny_settings(tiny_model_dir))
    try:
        assert engine.wait_ready(60).ready
        req = dict(temperature=0.0, max_tokens=60, ignore_eos=True)
        (reference,) = list(engine.submit(request(PROMPTS[0], **req)))
        forward = engine.core.runner.step
        started = threading.Event()
        calls = {"prefill": 0}

        def flaky(works):
            if any(w.start == 8 and len(w.tokens) > 1 for w in works):  # the victim's second chunk
                calls["prefill"] += 1
                raise RuntimeError("prefill forward failed")
            if all(len(w.tokens) == 1 for w in works):
                started.set()
            return forward(works)

        engine.core.runner.step = flaky
        keeper = engine.submit(request(PROMPTS[0], **req))
        assert started.wait(30)
        engine.core.scheduler.prefill_chunk_tokens = 8
        victim = engine.submit(request(PROMPTS[4], temperature=0.0, max_tokens=8))
        assert "prefill forward failed" in _one_error(victim).error.message
        (done,) = list(keeper)
        assert done.error is None and done.outputs[0].token_ids == reference.outputs[0].token_ids
        assert engine.stats()["requests_failed"] == 1 and not engine.core._live
    finally:
        engine.shutdown(0)


def test_a_decode_step_run_apart_through_the_static_buckets_keeps_each_requests_logits(stepped):
    """A shared decode step fails once; run request by request, each part goes through a decode
    bucket, whose outputs are buffers every step writes: each request's logits are kept before the
    next one runs, so both requests get their alone tokens."""
    from gyrfalcon.engine.model.captured import DecodeSteps

    engine = stepped()
    engine.core.runner.decode_steps = DecodeSteps(engine.core.runner, 8, 128, mode="static")
    asks = [request(PROMPTS[i], temperature=0.0, max_tokens=12, ignore_eos=True) for i in (0, 1)]
    expected = alone(engine, asks)
    streams = [engine.submit(request(PROMPTS[i], temperature=0.0, max_tokens=12, ignore_eos=True)) for i in (0, 1)]
    for _ in range(4):
        engine.core.batcher.step()
    step, failed = engine.core.runner.step, []

    def flaky(works):
        if len(works) == 2 and not failed:
            failed.append(True)
            raise RuntimeError("a shared step failed once")
        return step(works)

    engine.core.runner.step = flaky
    run(engine, streams)
    assert failed and finals(streams) == expected
