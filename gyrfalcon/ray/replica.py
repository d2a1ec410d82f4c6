"""One engine replica: an engine core (token ids only) behind Ray Serve's handle calls.

Every payload is the engine boundary's msgpack (:mod:`gyrfalcon.engine_api.codec`), the same
as over the engine process's socket. ``generate`` is a streaming call: its first item says whether
the core took the request (``["accepted", None]``) or refused it (``["refused", refusal]``), so the
API side still answers a refusal before it commits a status; then each item is
``["out", [output, …]]``, everything the step loop produced since the last item (a slow reader gets
fewer, larger items). A call the caller cancels (its client went away) aborts the request.

The other methods are small calls: ``info``, ``health``, ``stats``, and ``finish_choice`` and
``abort``, which the API side broadcasts to every replica (unknown ids are ignored), and the control
plane's, broadcast too, which answer a refusal as ``{codec.REFUSED: refusal}`` (the API side raises
it as it is: a 400 or 404 naming its field, not a replica's failure).

A broadcast reaches the replicas that run when it is made. One started later — autoscaled, or
replacing one that died — takes over what the calls made before it recorded
(:mod:`gyrfalcon.ray.state`: the weights pushed last, the adapters loaded or unloaded at run time,
a pause) once its model is loaded and before it takes a request, so that no request gets the
settings' weights, a 404 for an adapter, or generation during a pause, from it. Sleep is not taken
over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import os
import queue
from collections.abc import AsyncIterator, Callable
from typing import Any

from gyrfalcon.engine_api import codec
from gyrfalcon.errors import RequestError

log = logging.getLogger(__name__)


def _refusals_answered(method: Callable[..., Any]) -> Callable[..., Any]:
    """A control call that answers its core's refusal (see the module docstring) instead of raising it."""

    @functools.wraps(method)
    def call(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except RequestError as exc:
            return {codec.REFUSED: codec.encode_refusal(exc)}

    return call


class EngineReplica:
    """Holds one engine core, built from ``settings_json`` (:meth:`gyrfalcon.config.Settings.to_env`)."""

    def __init__(self, settings_json: str, state: Any = None) -> None:
        from gyrfalcon.compose import engine_core
        from gyrfalcon.config import Settings

        self.core = engine_core(Settings(**json.loads(settings_json)))
        #: the weights the last ``update_weights`` pushed here: [path, version]
        self._pushed: list[str] | None = None
        if state is not None:  # (a handle of the application's ServedState)
            self._take_over(lambda: _asked(state.get))

    async def generate(self, request: list[Any]) -> AsyncIterator[bytes]:
        """Run one encoded request (see the module docstring for the items)."""
        decoded = codec.decode_request(request)
        loop = asyncio.get_running_loop()
        try:  # compiling a grammar may take a while: off the replica's event loop
            if decoded.sampling.structured_outputs is not None:
                stream = await loop.run_in_executor(None, self.core.submit, decoded)
            else:
                stream = self.core.submit(decoded)
        except Exception as exc:  # noqa: BLE001 - a refusal travels back to the API side
            yield codec.pack(["refused", codec.encode_refusal(exc)])
            return
        ready = asyncio.Event()
        stream.set_waker(lambda: loop.call_soon_threadsafe(ready.set))
        ready.set()  # outputs may have come before the waker was set
        try:
            yield codec.pack(["accepted", None])
            while True:
                await ready.wait()
                ready.clear()
                batch, ended = _take_ready(stream)
                if batch:
                    yield codec.pack(["out", batch])
                if ended:
                    return
        finally:  # finished: a no-op; cancelled (the client went away): the engine aborts the request
            stream.set_waker(None)
            stream.close()

    def info(self) -> dict[str, Any]:
        return {"info": codec.encode_info(self.core.info()), "pid": os.getpid()}

    def health(self) -> list[Any]:
        return codec.encode_health(self.core.health())

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    def finish_choice(self, request_id: str, index: int, stop_reason: str | int | None = None) -> None:
        self.core.finish_choice(request_id, index, stop_reason)

    @_refusals_answered
    def pause(self, mode: str, clear_cache: bool) -> list[Any]:
        return codec.encode_result(self.core.pause(mode, clear_cache))

    @_refusals_answered
    def resume(self) -> list[Any]:
        return codec.encode_result(self.core.resume())

    def pause_state(self) -> list[Any]:
        return codec.encode_result(self.core.pause_state())

    def abort_requests(self, group_ids: list[str] | None) -> int:
        return self.core.abort_requests(group_ids)

    @_refusals_answered
    def update_weights(self, model_path: str, weight_version: str | None, flush_cache: bool = True) -> str:
        return self._push(model_path, weight_version, flush_cache)

    def _push(self, path: str, version: str | None, flush_cache: bool = True) -> str:
        version = self.core.update_weights(path, version, flush_cache)
        self._pushed = [path, version]
        return version

    @_refusals_answered
    def sleep(self, level: int) -> list[Any]:
        return codec.encode_result(self.core.sleep(level))

    @_refusals_answered
    def wake_up(self, tags: list[str] | None) -> list[Any]:
        return codec.encode_result(self.core.wake_up(tags))

    def sleep_state(self) -> list[Any]:
        return codec.encode_result(self.core.sleep_state())

    @_refusals_answered
    def load_lora_adapter(self, lora_name: str, lora_path: str, load_inplace: bool = False) -> None:
        self.core.load_lora_adapter(lora_name, lora_path, load_inplace)

    @_refusals_answered
    def unload_lora_adapter(self, lora_name: str) -> None:
        self.core.unload_lora_adapter(lora_name)

    def lora_adapters(self) -> list[list[str]]:
        return self.core.lora_adapters()

    def _take_over(self, recorded: Callable[[], dict[str, Any]]) -> None:
        """Once the model is loaded, serve what ``recorded()`` says the control calls made the
        replicas serve (:meth:`gyrfalcon.ray.state.ServedState.get`), asked again after each take-over
        until two answers agree (a call made meanwhile is taken too). Weights that cannot be loaded
        here fail the replica (Ray reports it and starts another): it would answer with other
        weights than the others; an adapter that cannot is logged and left out."""
        wait_ready = getattr(self.core, "wait_ready", None)
        if wait_ready is not None:
            wait_ready(TAKE_OVER_TIMEOUT_S)
        taken = None
        for _ in range(TAKE_OVER_ROUNDS):
            state = recorded()
            if state == taken:
                return
            self._apply(state)
            taken = state

    def _apply(self, state: dict[str, Any]) -> None:
        paused = self.core.pause_state().mode
        if state.get("paused") and paused != state["paused"]:  # first: nothing generates meanwhile
            self.core.pause(state["paused"], False)
            log.info("took over the replicas' pause (%s)", state["paused"])
        if state["weights"] and state["weights"] != self._pushed:
            path, version = state["weights"]
            self._push(path, version)
            log.info("took over the weights %s pushed from %s", version, path)
        held = dict(self.core.lora_adapters())  # (those of --lora-modules among them)
        for name, path in state["adapters"]:
            try:
                if path is None and name in held:
                    self.core.unload_lora_adapter(name)
                elif path is not None and held.get(name) != path:
                    self.core.load_lora_adapter(name, path, name in held)
            except RequestError as exc:
                log.warning("could not take over the LoRA adapter %s (%s): %s", name, path, exc)
        if not state.get("paused") and paused is not None:  # resumed since an earlier look
            self.core.resume()

    def __del__(self) -> None:
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown(grace=0.0)


#: seconds a new replica's engine has to be ready to take the recorded state over
TAKE_OVER_TIMEOUT_S = 600.0
#: the most times a new replica asks for the recorded state (it stops once two answers agree)
TAKE_OVER_ROUNDS = 5
#: seconds a call to the recorded state may take
STATE_TIMEOUT_S = 30.0


def _asked(method: Any) -> Any:
    """``method.remote()``'s answer (a deployment handle's method), waited for on a thread of its
    own: Ray refuses a blocking wait on a replica's event loop, where a constructor runs."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: method.remote().result(timeout_s=STATE_TIMEOUT_S)).result()


def _take_ready(stream: Any) -> tuple[list[Any], bool]:
    """The encoded outputs waiting in ``stream``, and whether it has ended."""
    batch = []
    while True:
        try:
            item = stream.get(timeout=0)
        except queue.Empty:
            return batch, False
        if item is None:
            return batch, True
        batch.append(codec.encode_output(item))
