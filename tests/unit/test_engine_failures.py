"""A step that raises fails the requests it held, in-band, and the loop keeps serving; a fault in
a prefill (or the first token of its group) fails that group only."""

from __future__ import annotations

import threading

import torch

from gyrfalcon.plugins.engines import create_transformers_engine
from tests.conftest import tiny_settings
from tests.unit.test_batching import PROMPTS, alone, finals, request, run, stepped  # noqa: F401 - fixture


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(tiny_model_dir):
    engine = create_transformers_engine(tiny_settings(tiny_model_dir))
    try:
        assert engine.wait_ready(60).ready
        forward = engine.runner.forward
        calls = {"n": 0}

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("boom")
            return forward(*args, **kwargs)

        engine.runner.forward = flaky
        (last,) = list(engine.submit(request(PROMPTS[0], n=2, temperature=1.0, max_tokens=10, ignore_eos=True)))
        assert last.finished and last.error is not None and "boom" in last.error.message
        assert engine.stats()["requests_failed"] == 1 and not engine._live
        (ok,) = list(engine.submit(request(PROMPTS[1], temperature=0.0, max_tokens=5, ignore_eos=True)))
        assert ok.error is None and len(ok.outputs[0].token_ids) == 5
    finally:
        engine.shutdown(0)


# ---------------------------------------------------------------- faults in the prefill path
# A stepped engine (tests/unit/test_batching.py): the batcher handles a prefill fault itself, so
# each step is deterministic and the running request's tokens can be compared with its alone run.


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
        engine.batcher.step()
    assert engine.batcher.running_sequences == 1 and engine.batcher.job is None
    return stream, expected


def _assert_engine_goes_on(engine, running, expected, failed):
    run(engine, [])
    assert finals([running]) == [expected]
    assert failed.request_id not in engine._live and engine._live == {}
    assert engine.stats()["requests_failed"] == 1
    streams = [engine.submit(request(PROMPTS[1], temperature=0.0, max_tokens=5, ignore_eos=True))]
    run(engine, streams)
    assert [len(c) for c in finals(streams)[0]] == [5]


def test_a_fault_sampling_the_first_token_fails_the_group_only(stepped):
    """The job left ``batcher.job`` before its first token was sampled: a raise there leaked it
    (in no list, stream never finished, still in ``_live``)."""
    engine = stepped()
    running, expected = _decoding(engine)
    sample = engine.sampler.sample
    calls = {"first_token": 0}

    def flaky(logits, rows):
        if all(not out for out in rows.output_token_ids):  # the first-token call, not a decode
            calls["first_token"] += 1
            if calls["first_token"] == 1:
                raise RuntimeError("processor exploded")
        return sample(logits, rows)

    engine.sampler.sample = flaky
    victim = engine.submit(request(PROMPTS[2], n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    engine.batcher.step()  # prefill (one chunk) + first token: raises inside
    assert calls["first_token"] == 1 and engine.batcher.job is None
    last = _one_error(victim)
    assert "processor exploded" in last.error.message and last.error.status == 500
    assert [c.finish_reason for c in last.outputs] == ["abort", "abort"]
    assert engine.batcher.running_sequences == 1  # the decoding request is still there
    _assert_engine_goes_on(engine, running, expected, victim)


def test_a_fault_gathering_prompt_logprobs_fails_the_group_only(stepped):
    engine = stepped()
    running, expected = _decoding(engine)
    gather = engine.sampler.gather_prompt_logprobs
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("gather failed")
        return gather(*args, **kwargs)

    engine.sampler.gather_prompt_logprobs = flaky
    victim = engine.submit(request(PROMPTS[2], temperature=0.0, max_tokens=4, prompt_logprobs=2))
    engine.batcher.step()
    assert "gather failed" in _one_error(victim).error.message
    _assert_engine_goes_on(engine, running, expected, victim)


def test_an_oom_merging_the_new_rows_fails_the_group_and_keeps_the_batch(stepped):
    engine = stepped()
    running, expected = _decoding(engine)
    kv = engine.batcher.kv
    merge = type(kv).merge
    calls = {"n": 0}

    def flaky(self, other):
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return merge(self, other)

    type(kv).merge = flaky
    try:
        victim = engine.submit(request(PROMPTS[2], temperature=0.0, max_tokens=8, ignore_eos=True))
        engine.batcher.step()
        assert calls["n"] == 1 and "out of memory" in _one_error(victim).error.message
        assert engine.batcher.running_sequences == 1 and engine.batcher.kv.rows == 1
        _assert_engine_goes_on(engine, running, expected, victim)
    finally:
        type(kv).merge = merge


def test_a_failed_prefill_chunk_spares_the_running_batch(stepped):
    """A fault in a (chunked) prefill forward fails the prefill's requests only; the decoding
    request's KV was never touched and it finishes with its alone result."""
    engine = stepped()
    running, expected = _decoding(engine)
    engine.scheduler.prefill_chunk_tokens = 8
    forward = engine.runner.forward
    calls = {"prefill": 0}

    def flaky(batch, token_ids, all_logits=False):
        if len(token_ids[0]) > 1:  # a prefill chunk (decode feeds one token per row)
            calls["prefill"] += 1
            if calls["prefill"] == 2:
                raise RuntimeError("prefill forward failed")
        return forward(batch, token_ids, all_logits=all_logits)

    engine.runner.forward = flaky
    victim = engine.submit(request(PROMPTS[4], temperature=0.0, max_tokens=8))  # 30 tokens: 4 chunks
    waiting = engine.submit(request(PROMPTS[1], temperature=0.0, max_tokens=5, ignore_eos=True))
    engine.batcher.step()
    assert engine.batcher.prefilling_requests() == 1
    engine.batcher.step()  # its second chunk raises
    assert engine.batcher.job is None and calls["prefill"] == 2
    assert "prefill forward failed" in _one_error(victim).error.message
    assert engine.batcher.running_sequences == 1
    run(engine, [])
    assert finals([running]) == [expected]
    assert [len(c) for c in finals([waiting])[0]] == [5]
    assert engine.stats()["requests_failed"] == 1 and not engine._live


def test_the_threaded_loop_survives_a_prefill_fault_while_another_request_decodes(tiny_model_dir):
    engine = create_transformers_engine(tiny_settings(tiny_model_dir))
    try:
        assert engine.wait_ready(60).ready
        req = dict(temperature=0.0, max_tokens=60, ignore_eos=True)
        (reference,) = list(engine.submit(request(PROMPTS[0], **req)))
        forward = engine.runner.forward
        started = threading.Event()
        calls = {"prefill": 0}

        def flaky(batch, token_ids, all_logits=False):
            if len(token_ids[0]) > 1:
                calls["prefill"] += 1
                if calls["prefill"] == 2:
                    raise RuntimeError("prefill forward failed")
            else:
                started.set()
            return forward(batch, token_ids, all_logits=all_logits)

        engine.runner.forward = flaky
        keeper = engine.submit(request(PROMPTS[0], **req))
        assert started.wait(30)
        victim = engine.submit(request(PROMPTS[4], temperature=0.0, max_tokens=8))
        assert "prefill forward failed" in _one_error(victim).error.message
        (done,) = list(keeper)
        assert done.error is None and done.outputs[0].token_ids == reference.outputs[0].token_ids
        assert engine.stats()["requests_failed"] == 1 and not engine._live
    finally:
        engine.shutdown(0)
