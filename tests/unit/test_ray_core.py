"""RayEngineCore's link logic on a stand-in for Ray's deployment handle (the engine path itself is
tested live in tests/live/test_ray.py): refusals, a dead pick placed again, a replica dying
mid-stream, aborts, stats."""

from __future__ import annotations

import asyncio
import time

import pytest

from gyrfalcon.engine_api.errors import QueueFull, ShuttingDown
from gyrfalcon.engine_api.types import (CompletionOutput, EngineHealth, EngineInfo, EngineRequest, PauseState, RequestOutput,
                                       SamplingParams)  # fmt: skip
from gyrfalcon.engine_process import codec
from gyrfalcon.errors import RequestError
from gyrfalcon.ray.core import RayEngineCore, add_stats
from gyrfalcon.api.errors import http_status

INFO = EngineInfo(model_path="m", vocab_size=100, max_model_len=64, eos_token_ids=[0], max_logprobs=5, max_num_seqs=4,
                  capabilities=frozenset())  # fmt: skip


def eventually(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


class ActorDiedError(Exception):
    """Named as Ray names it: the core recognises Ray's errors by their names."""


class BackPressureError(Exception):
    pass


class Call:
    """One streaming call: yields ``items`` (bytes, or an exception to raise), records a cancel."""

    def __init__(self, items: list) -> None:
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            if self.hang:
                await asyncio.sleep(3600)
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    hang = False

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """Deployment handle stand-in: ``calls`` are handed out in order to generate calls."""

    def __init__(self, calls: list[Call]) -> None:
        self.calls = calls
        self.broadcasts: list[tuple] = []

    def options(self, **_):
        return self

    @property
    def info(self):
        class Info:
            @staticmethod
            def remote():
                async def answer():
                    return {"info": codec.encode_info(INFO), "pid": 1}
                return answer()
        return Info

    @property
    def generate(self):
        handle = self

        class Generate:
            @staticmethod
            def remote(request):
                return handle.calls.pop(0)
        return Generate

    def broadcast(self, method, *args):
        self.broadcasts.append((method, *args))
        handle = self

        class Response:
            async def results_async(self, **_):
                if method in getattr(handle, "answers", {}):
                    return handle.answers[method]
                if method == "health":
                    return [codec.encode_health(EngineHealth(ready=True))]
                return [{"running": 2, "pid": 7, "kv_block_size": 16}, {"running": 1, "pid": 8, "kv_block_size": 16}]
        return Response()


def _request(rid: str = "r1") -> EngineRequest:
    return EngineRequest(rid, [1, 2], SamplingParams(max_tokens=2))


def _out(text: str, finished: bool = False) -> bytes:
    output = RequestOutput("r1", [CompletionOutput(0, text, [5], None, "length" if finished else None)], finished)
    return codec.pack(["out", [codec.encode_output(output)]])


ACCEPTED = codec.pack(["accepted", None])


@pytest.fixture
def make_core():
    cores = []

    def make(calls):
        core = RayEngineCore(Handle(calls))
        cores.append(core)
        return core

    yield make
    for core in cores:
        core.shutdown(grace=0)


def test_outputs_flow_and_the_stream_ends(make_core):
    core = make_core([Call([ACCEPTED, _out("a"), _out("b", finished=True)])])
    outputs = list(core.submit(_request()))
    assert "".join(o.outputs[0].text for o in outputs) == "ab" and outputs[-1].finished


def test_a_refusal_is_raised_with_its_param(make_core):
    refusal = codec.pack(["refused", codec.encode_refusal(RequestError("bad", "structured_outputs"))])
    core = make_core([Call([refusal])])
    with pytest.raises(RequestError) as info:
        core.submit(_request())
    assert info.value.param == "structured_outputs"


def test_a_control_calls_refusal_is_raised_as_the_core_raised_it(make_core):
    """A replica answers a refused load or weight update (the LoRA adapter's path, the weights'
    shapes) rather than raising it, which Ray would wrap: the caller hears the 400 or 404 naming the
    field, before any replica's failure."""
    from gyrfalcon.errors import Kind
    from gyrfalcon.ray.replica import EngineReplica

    class Core:
        def load_lora_adapter(self, *args):
            raise RequestError("'/x' does not exist on the server", "lora_path", type=Kind.NOT_FOUND)

        def shutdown(self, *args, **kwargs):
            pass

    replica = EngineReplica.__new__(EngineReplica)
    replica.core = Core()
    refused = replica.load_lora_adapter("a", "/x")
    core = make_core([])
    core._handle.answers = {"load_lora_adapter": [RuntimeError("a replica died"), refused]}
    with pytest.raises(RequestError) as info:
        core.load_lora_adapter("a", "/x")
    assert (info.value.param, info.value.type) == ("lora_path", Kind.NOT_FOUND)
    core._handle.answers = {"update_weights": [RuntimeError("a replica died"), "v2"]}
    with pytest.raises(ShuttingDown):
        core.update_weights("/y", "v2")


def test_a_dead_pick_is_placed_again_and_back_pressure_is_a_503(make_core):
    dead = Call([ActorDiedError("gone")])
    core = make_core([dead, Call([ACCEPTED, _out("x", finished=True)]), Call([BackPressureError("full")])])
    assert [o.outputs[0].text for o in core.submit(_request("r1"))] == ["x"]
    assert dead.cancelled
    with pytest.raises(QueueFull):
        core.submit(_request("r2"))


def test_a_replica_dying_mid_stream_ends_the_stream_with_a_503(make_core):
    core = make_core([Call([ACCEPTED, _out("a"), ActorDiedError("killed")])])
    outputs = list(core.submit(_request()))
    assert outputs[-1].finished and http_status(outputs[-1].error) == 503
    assert outputs[-1].error.type == ShuttingDown.type


def test_closing_a_stream_cancels_its_call(make_core):
    call = Call([ACCEPTED, _out("a")])
    call.hang = True
    core = make_core([call])
    stream = core.submit(_request())
    assert stream.get(timeout=5).outputs[0].text == "a"
    stream.close()
    assert eventually(lambda: call.cancelled)


def test_finish_choice_is_broadcast_and_stats_are_added_up(make_core):
    core = make_core([])
    core.finish_choice("r1", 2, "###")
    assert eventually(lambda: ("finish_choice", "r1", 2, "###") in core._handle.broadcasts)
    stats = core.stats()
    assert stats["running"] == 3 and stats["replicas"] == 2 and stats["pid"] == 7 and stats["kv_block_size"] == 16


def test_add_stats_keeps_non_counts_from_the_first():
    assert add_stats([{"a": 1, "flag": True, "name": "x"}, {"a": 2, "flag": False, "name": "y"}]) == {
        "a": 3, "flag": True, "name": "x", "replicas": 2}


def test_a_replica_started_later_takes_the_recorded_weights_and_adapters_over():
    """What the control calls recorded (``ServedState``) is applied once the model is loaded: the
    weights pushed (same path, same version); each adapter loaded, replaced in place where one of
    the settings' holds its name with another folder, unloaded where a call unloaded it; an adapter
    that cannot be loaded here left out; a pause taken first, a resume last; asked again until two
    answers agree. Weights that cannot be loaded fail the replica."""
    from gyrfalcon.ray.replica import EngineReplica
    from gyrfalcon.ray.state import ServedState

    class Core:
        def __init__(self) -> None:
            self.calls, self.adapters, self.paused = [], {"boot": "/boot", "old": "/old"}, None  # --lora-modules

        def wait_ready(self, timeout):
            self.calls.append("ready")

        def update_weights(self, path, version, flush_cache=True):
            if path == "/gone":
                raise RequestError("'/gone' does not exist on the server", "model_path")
            self.calls.append(("weights", path, version))
            return version

        def load_lora_adapter(self, name, path, load_inplace=False):
            if path == "/missing":
                raise RequestError("'/missing' does not exist on the server", "lora_path")
            if name in self.adapters and not load_inplace:
                raise RequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
            self.calls.append(("load", name, path))
            self.adapters[name] = path

        def unload_lora_adapter(self, name):
            self.calls.append(("unload", name))
            del self.adapters[name]

        def lora_adapters(self):
            return [[name, path] for name, path in self.adapters.items()]

        def pause_state(self):
            return PauseState(self.paused)

        def pause(self, mode, clear_cache=True):
            self.calls.append(("pause", mode))
            self.paused = mode

        def resume(self):
            self.calls.append("resume")
            self.paused = None

        def shutdown(self, *args, **kwargs):
            pass

    record = ServedState("{}")
    replica = EngineReplica.__new__(EngineReplica)
    replica.core, replica._pushed = Core(), None
    replica._take_over(record.get)  # nothing recorded: nothing to take
    assert replica.core.calls == ["ready"]
    record.weights("/w", "v7")
    for name, path in (("boot", "/boot"), ("old", "/new"), ("x", "/missing"), ("a", "/a"), ("gone", "/g"), ("gone", None)):
        record.adapter(name, path)
    asked = []
    replica.core.calls.clear()
    replica._take_over(lambda: asked.append(1) or record.get())
    assert replica.core.calls == ["ready", ("weights", "/w", "v7"), ("load", "old", "/new"), ("load", "a", "/a")]
    assert len(asked) == 2  # asked again once, the same answer
    assert replica.core.adapters == {"boot": "/boot", "old": "/new", "a": "/a"}
    record.adapter("boot", None)  # a call unloads one of the settings' adapters
    replica._take_over(record.get)
    assert "boot" not in replica.core.adapters
    record.paused("keep")  # paused: before anything else, so that nothing generates meanwhile
    record.weights("/w2", "v8")
    replica.core.calls.clear()
    replica._take_over(record.get)
    assert replica.core.calls == ["ready", ("pause", "keep"), ("weights", "/w2", "v8")]
    record.paused(None)
    replica._take_over(record.get)
    assert replica.core.calls[-1] == "resume" and replica.core.paused is None
    record.weights("/gone", "v8")
    with pytest.raises(RequestError):
        replica._take_over(record.get)


def test_the_adapters_listed_are_those_every_replica_holds(make_core):
    core = make_core([])
    core._handle.answers = {"lora_adapters": [[["a", "/a"], ["b", "/b"]], [["b", "/b"]]]}
    assert core.lora_adapters() == [["b", "/b"]]
