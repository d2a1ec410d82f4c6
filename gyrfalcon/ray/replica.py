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
"""

from __future__ import annotations

import asyncio
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

    def __init__(self, settings_json: str) -> None:
        from gyrfalcon.compose import engine_core
        from gyrfalcon.config import Settings

        self.core = engine_core(Settings(**json.loads(settings_json)))

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
        return self.core.update_weights(model_path, weight_version, flush_cache)

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

    def __del__(self) -> None:
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown(grace=0.0)


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
