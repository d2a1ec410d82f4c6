"""The engine behind ZeroMQ: the same results as in process, refusals, a dead worker's requests
aborted, a dead engine's clients answered at once, a hung step seen by /health."""

from __future__ import annotations

import dataclasses
import queue
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from gyrfalcon.client import EngineClient
from gyrfalcon.engine_api.errors import ShuttingDown
from gyrfalcon.engine_api.types import (
    CompletionOutput,
    EngineError,
    EngineRequest,
    OutputKind,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)
from gyrfalcon.engine_process import codec
from gyrfalcon.engine_process.remote import RemoteEngineCore
from gyrfalcon.engine_process.server import EngineServer
from gyrfalcon.errors import Kind, RequestError
from gyrfalcon.api.errors import http_status


@pytest.fixture
def served(slow_engine, tmp_path):
    """``slow_engine``'s core served over ZeroMQ from a thread; yields (address, server)."""
    address = f"ipc://{tmp_path}/engine.sock"
    server = EngineServer(slow_engine.core, address, silence_s=1.0)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    yield address, server
    server.stop()
    thread.join(5)


@pytest.fixture
def remote(served, slow_engine):
    """An API worker's engine: the text work here, the core over the socket."""
    core = RemoteEngineCore(served[0], silence_s=1.0)
    engine = EngineClient(core, slow_engine.tokenizer, model_name="tiny")
    yield engine
    engine.shutdown(0)


def _request(engine, request_id: str, kind=OutputKind.FINAL_ONLY, **sampling) -> EngineRequest:
    return EngineRequest(request_id, engine.tokenize("The quick brown fox"), SamplingParams(**sampling), kind)


def test_codec_round_trips_every_field():
    lp = TokenLogprobs([5, 6], [-0.5, None], [[1, 2], [3]], [[-1.0, -2.0], [-3.0]], [1, None], [[1, 2], [1]])
    out = RequestOutput("r", [CompletionOutput(1, "hé", [5, 6], lp, "stop", "\n"), CompletionOutput(0)], True,
                        [1, 2], lp, 7, EngineError("boom", "t", "p", 1.5), 0.25)  # fmt: skip
    assert codec.decode_output("r", codec.unpack(codec.pack(codec.encode_output(out)))) == out
    request = EngineRequest("id", [1, 2], SamplingParams(n=3, seed=2**63, logit_bias={7: -1.5}, stop=["x"],
                            logprob_token_ids=[4]), OutputKind.DELTA, {"ext": {"a": [1]}}, "salt", 2, "group")  # fmt: skip
    assert codec.decode_request(codec.unpack(codec.pack(codec.encode_request(request)))) == request


@pytest.mark.parametrize("slow_engine", [0.0], indirect=True)
def test_remote_results_equal_in_process(slow_engine, remote):
    """Seeded sampling with n > 1, logprobs, explicit ids and prompt logprobs: token for token."""
    asked = dict(n=3, seed=11, temperature=0.9, max_tokens=12, logprobs=2, logprob_token_ids=[3, 9],
                 prompt_logprobs=1)  # fmt: skip
    for kind in (OutputKind.FINAL_ONLY, OutputKind.DELTA):
        here = list(slow_engine.submit(_request(slow_engine, f"local-{kind.value}", kind, **asked)))
        there = list(remote.submit(_request(remote, f"remote-{kind.value}", kind, **asked)))

        def totals(outputs):
            by_choice = {}
            for output in outputs:
                for c in output.outputs:
                    text, ids, lps = by_choice.get(c.index, ("", [], []))
                    by_choice[c.index] = (text + c.text if kind is OutputKind.DELTA else c.text,
                                          ids + c.token_ids if kind is OutputKind.DELTA else c.token_ids,
                                          lps + [c.logprobs])  # fmt: skip
            return {i: (t, ids) for i, (t, ids, _) in by_choice.items()}, outputs[-1].prompt_logprobs

        assert totals(there) == totals(here)
        assert len(totals(there)[0]) == 3 and there[-1].finished
    assert remote.info().decode_path == slow_engine.info().decode_path == remote.health().decode_path is not None


def test_refusals_travel_back_as_typed_errors(remote):
    too_wide = EngineRequest("wide", [1] * 10, SamplingParams(n=4096, max_tokens=100))  # beyond the KV cache
    with pytest.raises(RequestError) as refused:
        remote.submit(too_wide)
    assert refused.value.param == "max_tokens" and refused.value.type == Kind.INVALID
    stream = remote.submit(_request(remote, "same", OutputKind.DELTA, max_tokens=200, ignore_eos=True))
    with pytest.raises(RequestError) as duplicate:
        remote.submit(_request(remote, "same", max_tokens=2))
    assert duplicate.value.param == "request_id"
    stream.close()


def test_abort_and_finish_choice_reach_the_engine(slow_engine, remote):
    before = slow_engine.core.stats()["requests_aborted"]
    stream = remote.submit(_request(remote, "to-abort", OutputKind.DELTA, max_tokens=200, ignore_eos=True))
    first = stream.get(timeout=10)
    assert first is not None and first.error is None
    stream.close()
    deadline = time.monotonic() + 5
    while slow_engine.core.stats()["requests_aborted"] == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert slow_engine.core.stats()["requests_aborted"] == before + 1
    assert slow_engine.core.stats()["running"] == 0


@pytest.mark.parametrize("slow_engine", [0.02], indirect=True)
def test_a_dead_workers_requests_are_aborted(slow_engine, served):
    """A worker killed with SIGKILL sends no goodbye: the engine aborts its requests once it falls silent.

    20 ms a step: the doomed request's 200 tokens take 4 s, well past the 1 s of silence (at the
    default 4 ms it could finish first: it did once in a clean-clone CI run, 0 aborted)."""
    before = slow_engine.core.stats()["requests_aborted"]
    worker = textwrap.dedent(f"""
        import os, sys
        from gyrfalcon.engine_process.remote import RemoteEngineCore
        from gyrfalcon.engine_api.types import EngineRequest, SamplingParams, OutputKind
        core = RemoteEngineCore({served[0]!r})
        stream = core.submit(EngineRequest("doomed", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True),
                                           OutputKind.DELTA))
        stream.get(timeout=10)
        print("running", flush=True)
        os._exit(0)
    """)
    done = subprocess.run([sys.executable, "-c", worker], capture_output=True, text=True, timeout=60)
    assert "running" in done.stdout, done.stderr
    deadline = time.monotonic() + 5
    while slow_engine.core.stats()["requests_aborted"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slow_engine.core.stats()["requests_aborted"] == before + 1
    assert slow_engine.core.stats()["running"] == 0


def test_a_gone_engine_ends_every_open_stream_at_once(served, remote):
    address, server = served
    streams = [remote.submit(_request(remote, f"open-{i}", OutputKind.DELTA, max_tokens=200, ignore_eos=True))
               for i in range(3)]  # fmt: skip
    for stream in streams:
        assert stream.get(timeout=10) is not None
    server.stop()  # closes the socket as the process's death would
    started = time.monotonic()
    for stream in streams:
        last = list(stream)[-1]
        assert last.finished and last.error is not None and http_status(last.error) == 503
    assert time.monotonic() - started < 2.0
    while remote.health().ready and time.monotonic() - started < 2.0:  # the socket's close, seen by its monitor
        time.sleep(0.01)
    assert not remote.health().ready and "engine process is gone" in remote.health().message
    with pytest.raises(ShuttingDown):
        remote.submit(_request(remote, "after", max_tokens=2))


def test_worker_drain_refuses_new_and_cuts_what_is_left(remote):
    stream = remote.submit(_request(remote, "draining", OutputKind.DELTA, max_tokens=240, ignore_eos=True))
    assert stream.get(timeout=10) is not None
    remote.drain(0.2)
    with pytest.raises(ShuttingDown):
        remote.submit(_request(remote, "late", max_tokens=2))
    last = list(stream)[-1]
    assert last.error is not None and http_status(last.error) == 503 and last.error.retry_after == 1.0


@pytest.mark.parametrize("slow_engine", [0.6], indirect=True)
def test_health_reports_a_step_that_hangs(slow_engine, monkeypatch):
    import gyrfalcon.engine.transformers_engine as engine_module

    monkeypatch.setattr(engine_module, "STEP_STALL_S", 0.3)
    stream = slow_engine.submit(_request(slow_engine, "stuck", OutputKind.DELTA, max_tokens=3))
    deadline = time.monotonic() + 5
    while slow_engine.health().ready and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "step loop is stuck" in slow_engine.health().message
    list(stream)
    time.sleep(0.1)
    assert slow_engine.health().ready


def test_an_engine_whose_model_cannot_load_exits_non_zero(tiny_model_dir, tmp_path):
    """Weights that cannot be read: the engine process says why and exits 1, so its launcher (and
    a supervisor) sees it, instead of serving a health 503 for ever."""
    import os
    import shutil

    from tests.conftest import tiny_settings

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    env = {**os.environ, "GYRFALCON_SETTINGS": tiny_settings(str(broken)).to_env()}
    address = f"ipc://{tmp_path}/engine.sock"
    done = subprocess.run([sys.executable, "-m", "gyrfalcon.engine_main", address], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert "exiting: model failed to load" in done.stderr


def test_a_slow_submit_delays_only_its_own_request(served, remote, slow_engine, monkeypatch):
    """A submit that takes longer than the workers wait for a heartbeat (a slow validation or
    grammar check): the engine's heartbeats go on, an open stream is not cut, and the slow request
    is served when its submit ends."""
    open_stream = remote.submit(_request(remote, "open", OutputKind.DELTA, max_tokens=60, ignore_eos=True))
    assert open_stream.get(timeout=10) is not None
    submit = slow_engine.core.submit

    def slow(request):
        if request.request_id.endswith(":slow"):
            time.sleep(2.5)  # the remote takes 1 s of silence for the engine's death
        return submit(request)

    monkeypatch.setattr(slow_engine.core, "submit", slow)
    (last,) = list(remote.submit(_request(remote, "slow", max_tokens=3)))
    assert last.finished and last.error is None and remote.health().ready
    outputs = list(open_stream)
    assert outputs[-1].finished and outputs[-1].error is None


def test_a_request_behind_a_slow_submit_is_not_held_and_an_abort_waits_for_its_submit(served, remote, slow_engine,
                                                                                        monkeypatch):  # fmt: skip
    """Submits run beside each other: a request sent while another's submit is slow (a grammar's
    compile) is served meanwhile; an abort of the slow one that comes during its submit is applied
    once the submit ends, not lost."""
    submit = slow_engine.core.submit
    slow_started = threading.Event()

    def slow(request):
        if request.request_id.endswith(":slow"):
            slow_started.set()
            time.sleep(2.0)
        return submit(request)

    monkeypatch.setattr(slow_engine.core, "submit", slow)
    slow_stream: list = []
    sender = threading.Thread(target=lambda: slow_stream.append(
        remote.submit(_request(remote, "slow", OutputKind.DELTA, max_tokens=200, ignore_eos=True))))  # fmt: skip
    sender.start()
    assert slow_started.wait(10)
    (fast,) = list(remote.submit(_request(remote, "fast", max_tokens=3)))
    assert fast.finished and fast.error is None and sender.is_alive()  # served while the slow submit ran
    remote.abort("slow")
    sender.join(10)
    outputs = list(slow_stream[0])
    assert outputs[-1].finished and len(outputs) < 200
    assert all(choice.finish_reason == "abort" for choice in outputs[-1].outputs), outputs[-1]


def _until_settled(engine) -> None:
    deadline = time.monotonic() + 10
    while not engine.pause_state().settled:
        assert time.monotonic() < deadline, engine.pause_state()
        time.sleep(0.005)


def test_pause_resume_and_abort_by_id_travel_across_the_socket(slow_engine, remote):
    """The control calls reach the core through the engine process: a keep pause holds a new
    request until the resume, an abort by group id ends only that group, a bad mode comes back as
    the same 400."""
    long = dict(max_tokens=80, ignore_eos=True, temperature=0.0)
    running = remote.submit(dataclasses.replace(_request(remote, "running", OutputKind.DELTA, **long), group_id="g1"))
    assert running.get(timeout=10) is not None
    assert remote.pause("keep").mode == "keep"
    _until_settled(remote)
    held = remote.submit(dataclasses.replace(_request(remote, "held", **long), group_id="g2"))
    assert remote.pause_state().held == 1
    with pytest.raises(queue.Empty):  # nothing of it runs while paused
        held.get(timeout=0.2)
    assert remote.abort_requests(["g1"]) == 1
    assert remote.resume().mode is None
    outputs = list(running)
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    (final,) = list(held)
    assert final.outputs[0].finish_reason == "length" and len(final.outputs[0].token_ids) == 80
    with pytest.raises(RequestError) as refused:
        remote.pause("sometimes")
    assert refused.value.param == "mode" and remote.pause_state().mode is None


def test_new_weights_travel_across_the_socket_and_a_misfit_comes_back_as_the_400(slow_engine, remote, tmp_path):
    """An update of the weights is a call of seconds: the engine process runs it off its socket's
    thread (the heartbeats go on), and its answer or refusal comes back."""
    from gyrfalcon.models.tiny import build_tiny_model

    assert remote.health().weight_version == "default"
    assert remote.update_weights(str(build_tiny_model(tmp_path / "new", seed=1)), "v2") == "v2"
    deadline = time.monotonic() + 5
    while remote.health().weight_version != "v2":  # the next heartbeat says so
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(RequestError) as refused:
        remote.update_weights(str(build_tiny_model(tmp_path / "other", vocab_size=384)))
    assert refused.value.param == "model_path" and "embed_tokens" in refused.value.message
    assert slow_engine.health().weight_version == "v2" and remote.health().ready
    # a sleep, its state and the wake travel too; the wake's weights come from the last update's folder
    remote.sleep(2)
    deadline = time.monotonic() + 10
    while not remote.sleep_state().settled:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert remote.sleep_state().asleep == ("kv_cache", "weights")
    with pytest.raises(RequestError) as refused:
        remote.wake_up(["disk"])
    assert refused.value.param == "tags"
    assert remote.wake_up().level == 0 and slow_engine.health().weight_version == "v2"
