"""Abort: a closed stream (streaming or not) frees its sequences within a step; the rest go on unchanged."""

from __future__ import annotations

import threading
import time

from gyrfalcon.engine_api.types import OutputKind
from tests.unit.test_batching import PROMPTS, alone, finals, request, run, stepped  # noqa: F401 - fixture


def long_requests():
    return [
        request(PROMPTS[0], temperature=0.0, max_tokens=40, ignore_eos=True),
        request(PROMPTS[1], n=3, temperature=1.0, seed=4, max_tokens=40, ignore_eos=True),
        request(PROMPTS[2], temperature=0.9, seed=5, max_tokens=40, ignore_eos=True, kind=OutputKind.DELTA),
    ]


def test_closing_a_non_streaming_request_shrinks_the_batch_at_the_next_step(stepped):
    engine = stepped()
    expected = alone(engine, long_requests())
    keep_a, victim, keep_c = (engine.submit(r) for r in long_requests())
    for _ in range(6):
        engine.core.batcher.step()
    assert engine.core.batcher.running_sequences == 5
    victim.close()  # what the serving thread does when it sees the client is gone
    engine.core.batcher.step()
    assert engine.core.batcher.running_sequences == 2
    assert victim.request_id not in engine.core._live and engine.stats()["requests_aborted"] == 1
    run(engine, [])
    got = finals([keep_a])
    assert got == [expected[0]]
    tokens = [t for item in keep_c for c in item.outputs for t in c.token_ids]
    assert [tokens] == expected[2]


def test_abort_reports_abort_and_partial_output(stepped):
    engine = stepped()
    stream = engine.submit(long_requests()[1])
    for _ in range(4):
        engine.core.batcher.step()
    engine.abort(stream.request_id)
    engine.core.batcher.step()
    (last,) = list(stream)
    assert last.finished and [c.finish_reason for c in last.outputs] == ["abort"] * 3
    assert all(len(c.token_ids) == 4 for c in last.outputs)  # one token per step, the first from the prefill
    assert engine.core.batcher.idle


def test_abort_during_a_chunked_prefill_drops_the_prefill(stepped):
    engine = stepped()
    engine.core.scheduler.prefill_chunk_tokens = 4
    stream = engine.submit(request(PROMPTS[4], temperature=0.0, max_tokens=5))
    engine.core.batcher.step()
    assert engine.core.batcher.prefilling_requests() == 1
    stream.close()
    engine.core.batcher.step()
    assert engine.core.batcher.prefilling_requests() == 0 and engine.core.batcher.idle and not engine.core._live
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]


def test_abort_of_a_waiting_request_answers_at_once(stepped):
    engine = stepped()
    stream = engine.submit(request(PROMPTS[0], max_tokens=5))
    engine.abort(stream.request_id)
    (last,) = list(stream)
    assert last.outputs[0].finish_reason == "abort" and len(engine.core.scheduler) == 0


def test_close_from_another_thread_frees_a_running_request(tiny_model_dir):
    from gyrfalcon.plugins.engines import create_transformers_engine
    from tests.conftest import tiny_settings

    engine = create_transformers_engine(tiny_settings(tiny_model_dir, max_model_len=256))
    try:
        assert engine.wait_ready(60).ready
        slow = engine.core.runner.step

        def forward(*args, **kwargs):  # slow the steps down so the request is surely running
            time.sleep(0.005)
            return slow(*args, **kwargs)

        engine.core.runner.step = forward
        other = engine.submit(request(PROMPTS[3], temperature=0.0, max_tokens=30, ignore_eos=True))
        victim = engine.submit(request(PROMPTS[1], n=2, temperature=1.0, max_tokens=200, ignore_eos=True))
        deadline = time.monotonic() + 10
        while engine.stats()["running_sequences"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        steps = engine.stats()["decode_forwards"]
        threading.Thread(target=victim.close).start()  # the serving thread noticing the client left
        while victim.request_id in engine.core._live:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert engine.stats()["decode_forwards"] - steps <= 3
        (done,) = list(other)
        assert done.outputs[0].finish_reason == "length" and len(done.outputs[0].token_ids) == 30
    finally:
        engine.shutdown(0)


class Gone:
    """A :class:`gyrfalcon.serving.runner.Disconnect` the test sets by hand."""

    def __init__(self):
        self.gone, self.listeners = False, []

    def is_set(self):
        return self.gone

    def add_listener(self, callback):
        self.listeners.append(callback)

    def leave(self):
        self.gone = True
        for callback in self.listeners:
            callback()


def test_a_reader_wakes_on_outputs_from_the_step_thread_and_stops_when_the_client_leaves(stepped):
    import asyncio

    import pytest

    from gyrfalcon.protocol.requests import ServingRequest
    from gyrfalcon.serving.runner import ClientGone, OutputReader

    engine = stepped()
    stream = engine.submit(request(PROMPTS[0], temperature=0.0, max_tokens=40, ignore_eos=True, kind=OutputKind.DELTA))
    serving = ServingRequest(endpoint="completions", model="tiny", response_id="r", requests=[])
    gone = Gone()

    async def read():
        reader = OutputReader(serving, [stream], gone)
        waiting = asyncio.ensure_future(reader.next(0))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # nothing yet: the reader sleeps, no thread blocks on the stream
        # the engine steps in another thread (the prefill gives the first token): its output wakes the reader
        assert await asyncio.get_running_loop().run_in_executor(None, engine.core.batcher.step)
        first = await asyncio.wait_for(waiting, 10)
        gone.leave()
        with pytest.raises(ClientGone):
            await reader.next(0)
        reader.close()
        return first

    first = asyncio.run(read())
    assert first is not None and len(first.outputs[0].token_ids) == 1
    engine.core.batcher.step()
    assert engine.core.batcher.idle and not engine.core._live and engine.stats()["requests_aborted"] == 1


def test_abort_during_the_last_prefill_forward_still_ends_the_request(stepped):
    engine = stepped()
    stream = engine.submit(request(PROMPTS[0], n=2, temperature=1.0, max_tokens=5))
    forward = engine.core.runner.step

    def abort_meanwhile(*args, **kwargs):  # the client leaves while the prompt is being prefilled
        engine.abort(stream.request_id)
        return forward(*args, **kwargs)

    engine.core.runner.step = abort_meanwhile
    engine.core.batcher.step()
    last = stream.get(timeout=5)  # without the fix the request leaked and this timed out
    assert last.finished and [c.finish_reason for c in last.outputs] == ["abort", "abort"]
    assert stream.get(timeout=5) is None
    assert not engine.core._live and engine.core.batcher.idle and engine.stats()["requests_aborted"] == 1
