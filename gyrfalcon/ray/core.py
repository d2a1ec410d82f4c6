"""The API side of Ray Serve: :class:`RayEngineCore`, engine replicas behind the ``EngineCore`` API.

Calls go through a Ray Serve deployment handle to :class:`gyrfalcon.ray.replica.EngineReplica`
replicas; the handle's request router picks the replica of each ``generate`` call
(:mod:`gyrfalcon.ray.router`: requests that share a prompt prefix go to the same replica while load
allows). One private asyncio loop, on its own thread, makes every handle call and pumps each
stream's items into the request's :class:`OutputStream` (whose waker wakes the HTTP task), so the
callers — the API's executor threads — never touch Ray's loops.

- ``submit`` waits for the replica's first item: a refusal is raised before the API commits a
  status, as in one process.
- Closing a stream (the client went away) cancels its call: Ray cancels the replica's generator,
  which aborts the request in that engine.
- ``finish_choice`` (a stop string matched here) is broadcast to every replica: only the one that
  runs the request knows its id.
- A replica that dies ends its streams with a 503 error item at once (Ray reports the actor's
  death to the pending call); a refusal for back-pressure (Ray's queue for the deployment is full)
  is a 503 with ``Retry-After``.
- ``health`` is ready while any replica is (polled every half second); ``stats`` adds the
  replicas' counters up.
- The control calls (``pause``, ``resume``, ``pause_state``, ``abort_requests``, ``sleep``,
  ``wake_up``, ``sleep_state``, ``update_weights``, the LoRA adapters') go to every replica and
  answer once each has applied them (a pause or a sleep has settled once it has on every one); the
  weights', adapters' and pause's calls are then recorded for the replicas Ray starts later
  (:mod:`gyrfalcon.ray.state`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any

from gyrfalcon.engine_api.errors import SHUTTING_DOWN, EngineUnavailable, QueueFull, ShuttingDown
from gyrfalcon.engine_api.interface import EngineCore, OutputStream
from gyrfalcon.engine_api.streams import CoalescingOutputStream
from gyrfalcon.engine_api.types import (EngineError, EngineHealth, EngineInfo, EngineRequest, PauseState, RequestOutput,
                                       SleepState, WAKE_TAGS)  # fmt: skip
from gyrfalcon.engine_api import codec
from gyrfalcon.logtext import loggable

log = logging.getLogger(__name__)

#: seconds a submit waits for a replica's first answer (routing included), then a 503
CALL_TIMEOUT_S = 30.0
#: seconds the API waits for the replicas' info at start (they may still be loading the model)
CONNECT_TIMEOUT_S = 600.0
#: seconds a health or stats broadcast waits
BROADCAST_TIMEOUT_S = 5.0
#: seconds every replica has to load new weights and swap them in
UPDATE_TIMEOUT_S = 600.0
#: seconds between two polls of the replicas' health
HEALTH_POLL_S = 0.5
#: tries to place a request when the chosen replica turns out to be dead (it ran nothing yet)
START_ATTEMPTS = 3
#: Ray's errors for a replica that died or cannot be reached
_REPLICA_GONE = frozenset({"ActorDiedError", "ActorUnavailableError", "RayActorError"})
#: stats that are not counts: taken from one replica, not added up
_NOT_ADDED = frozenset({"pid", "kv_block_size"})


class RayEngineCore(EngineCore):
    """An :class:`EngineCore` whose engines are the replicas behind ``handle`` (see the module)."""

    def __init__(self, handle: Any, state: Any = None, *, connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self._handle = handle
        #: the application's :class:`~gyrfalcon.ray.state.ServedState` (a handle), where control calls are recorded
        self._state = state
        self._streaming = handle.options(stream=True)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gyrfalcon-ray-link", daemon=True)
        self._thread.start()
        #: each running request's pump task and stream
        self._calls: dict[str, tuple[asyncio.Future[Any], OutputStream]] = {}
        self._draining = False
        first = self._run(self._handle.info.remote(), connect_timeout)
        self._info = codec.decode_info(first["info"])
        self._health = EngineHealth(ready=False, message="asking the engine replicas")
        asyncio.run_coroutine_threadsafe(self._poll_health(), self._loop)

    # ------------------------------------------------------------------ EngineCore

    def info(self) -> EngineInfo:
        return self._info

    def submit(self, request: EngineRequest) -> OutputStream:
        if self._draining:
            raise ShuttingDown("the server is shutting down")
        stream = CoalescingOutputStream(request.request_id, request.output_kind, on_close=self.abort)
        started = asyncio.run_coroutine_threadsafe(self._start(request, stream), self._loop)
        try:
            refusal = started.result(CALL_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            started.cancel()
            self.abort(request.request_id)
            raise EngineUnavailable(f"no engine replica took the request within {CALL_TIMEOUT_S:.0f} s") from None
        if refusal is not None:
            codec.raise_refusal(refusal)
        return stream

    def abort(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self._cancel, request_id)

    def finish_choice(self, request_id: str, index: int, stop_reason: str | int | None = None) -> None:
        self._loop.call_soon_threadsafe(self._broadcast, "finish_choice", request_id, index, stop_reason)

    def health(self) -> EngineHealth:
        """The replicas' health as last polled (every ``HEALTH_POLL_S``; never waits: /health runs
        on the event loop)."""
        if self._draining:
            return EngineHealth(ready=False, message="the server is shutting down")
        return self._health

    def stats(self) -> dict[str, Any]:
        try:
            answers = self._run(self._gather("stats"), BROADCAST_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - /metrics then shows the request metrics alone
            return {}
        return add_stats([a for a in answers if isinstance(a, dict)])

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> PauseState:
        state = _joined(self._run(self._gather("pause", mode, clear_cache), BROADCAST_TIMEOUT_S))
        self._record("paused", mode)
        return state

    def resume(self) -> PauseState:
        state = _joined(self._run(self._gather("resume"), BROADCAST_TIMEOUT_S))
        self._record("paused", None)
        return state

    def pause_state(self) -> PauseState:
        return _joined(self._run(self._gather("pause_state"), BROADCAST_TIMEOUT_S))

    def update_weights(self, model_path: str, weight_version: str | None = None, flush_cache: bool = True) -> str:
        """Every replica loads and swaps; answered once all have (a replica that refuses, or fails,
        is the error, and the others may already serve the new weights)."""
        answers = self._run(self._gather("update_weights", model_path, weight_version, flush_cache, timeout=UPDATE_TIMEOUT_S),
                            UPDATE_TIMEOUT_S)  # fmt: skip
        version = str(_answered(answers)[0])
        self._record("weights", model_path, version)
        return version

    def sleep(self, level: int = 1) -> SleepState:
        return _slept(self._run(self._gather("sleep", level), BROADCAST_TIMEOUT_S))

    def wake_up(self, tags: list[str] | None = None) -> SleepState:
        return _slept(self._run(self._gather("wake_up", tags, timeout=UPDATE_TIMEOUT_S), UPDATE_TIMEOUT_S))

    def sleep_state(self) -> SleepState:
        return _slept(self._run(self._gather("sleep_state"), BROADCAST_TIMEOUT_S))

    def load_lora_adapter(self, lora_name: str, lora_path: str, load_inplace: bool = False) -> None:
        """Every replica loads it; answered once all have (one that refuses is the error)."""
        _answered(self._run(self._gather("load_lora_adapter", lora_name, lora_path, load_inplace, timeout=UPDATE_TIMEOUT_S),
                            UPDATE_TIMEOUT_S))  # fmt: skip
        self._record("adapter", lora_name, lora_path)

    def unload_lora_adapter(self, lora_name: str) -> None:
        _answered(self._run(self._gather("unload_lora_adapter", lora_name), BROADCAST_TIMEOUT_S))
        self._record("adapter", lora_name, None)

    def _record(self, method: str, *args: Any) -> None:
        """A control call every replica applied, recorded for the replicas Ray starts later
        (:mod:`gyrfalcon.ray.state`); the call stands where the record fails, which is logged."""
        if self._state is None:
            return
        try:
            self._run(getattr(self._state, method).remote(*args), BROADCAST_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the replicas serve it; only later ones will not
            log.warning("could not record %s%r for the replicas started later", method, args, exc_info=True)

    def lora_adapters(self) -> list[list[str]]:
        """The adapters every replica holds (one a replica could not take over is not served)."""
        first, *others = _answered(self._run(self._gather("lora_adapters"), BROADCAST_TIMEOUT_S))
        held = [{tuple(adapter) for adapter in answer} for answer in others]
        return [adapter for adapter in first if all(tuple(adapter) in h for h in held)]

    def abort_requests(self, group_ids: list[str] | None = None) -> int:
        return sum(_answered(self._run(self._gather("abort_requests", group_ids), BROADCAST_TIMEOUT_S)))

    def drain(self, timeout: float) -> None:
        """This ingress stops: new requests are refused, and those still open after ``timeout``
        seconds end with a 503 (Ray Serve drains the engine replicas on its own)."""
        self._draining = True
        timer = threading.Timer(max(timeout, 0.0), self._loop.call_soon_threadsafe, args=(self._cut_all,))
        timer.daemon = True
        timer.start()

    def shutdown(self, grace: float = 5.0) -> None:
        deadline = time.monotonic() + max(grace, 0.0)
        while self._calls and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._loop.is_running():
            error = EngineError("the server shut down", type=ShuttingDown.type, retry_after=1.0)
            try:
                asyncio.run_coroutine_threadsafe(self._close(error), self._loop).result(5.0)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------ the loop's side

    def _run(self, awaitable: Any, timeout: float) -> Any:
        async def wait() -> Any:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(wait(), self._loop).result(timeout)

    async def _start(self, request: EngineRequest, stream: OutputStream) -> list[Any] | None:
        """Send ``request``; None once a replica took it (its items then flow into ``stream``), else
        the refusal."""
        encoded = codec.encode_request(request)
        for attempt in range(START_ATTEMPTS):
            call = self._streaming.generate.remote(encoded)
            try:
                kind, refusal = codec.unpack(await call.__anext__())
                break
            except asyncio.CancelledError:
                call.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - no replica took it
                call.cancel()
                # a replica that died before taking the request: the router has not seen it go yet
                if type(exc).__name__ in _REPLICA_GONE and attempt + 1 < START_ATTEMPTS:
                    continue
                return codec.encode_refusal(_unavailable(exc))
        if kind == "refused":
            return refusal
        task = asyncio.ensure_future(self._pump(request.request_id, call, stream))
        self._calls[request.request_id] = (task, stream)
        return None

    async def _pump(self, request_id: str, call: Any, stream: OutputStream) -> None:
        try:
            async for payload in call:
                _kind, batch = codec.unpack(payload)
                for output in batch:
                    stream.put(codec.decode_output(request_id, output))
        except asyncio.CancelledError:
            call.cancel()  # Ray cancels the replica's generator, which aborts the request there
            return  # whoever cancelled ends the stream, if it is to be ended
        except Exception as exc:  # noqa: BLE001 - the replica died or the call failed mid-stream
            log.warning("request %s lost its engine replica: %s", loggable(request_id), exc)
            stream.put(RequestOutput(request_id, [], finished=True, error=EngineError(
                f"the engine replica running this request failed ({type(exc).__name__})",
                type=ShuttingDown.type, retry_after=1.0)))  # fmt: skip
        finally:
            self._calls.pop(request_id, None)
        stream.finish()

    def _cancel(self, request_id: str, error: EngineError | None = None) -> None:
        """Cancel a request's call; with ``error``, its stream ends with that error (else its reader
        has gone)."""
        entry = self._calls.pop(request_id, None)
        if entry is None:
            return
        task, stream = entry
        task.cancel()
        if error is not None:
            stream.put(RequestOutput(request_id, [], finished=True, error=error))
            stream.finish()

    def _cut_all(self, error: EngineError = SHUTTING_DOWN) -> None:
        for request_id in list(self._calls):
            self._cancel(request_id, error)

    def _broadcast(self, method: str, *args: Any) -> None:
        try:
            self._handle.broadcast(method, *args)
        except Exception:  # noqa: BLE001 - a hint: the API side drops what follows anyway
            log.debug("broadcast %s failed", method, exc_info=True)

    async def _close(self, error: EngineError) -> None:
        """End every open stream with ``error``, then stop the loop's tasks (the health poll)."""
        self._cut_all(error)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _poll_health(self) -> None:
        while True:
            try:
                answers = await self._gather("health")
            except Exception as exc:  # noqa: BLE001 - no replica answered
                self._health = EngineHealth(ready=False, message=f"no engine replica answered ({type(exc).__name__})")
            else:
                healths = [codec.decode_health(a) for a in answers if not isinstance(a, BaseException)]
                ready = sum(h.ready for h in healths)
                # the replicas' weights: one version, or during an update every version still served
                version = ",".join(sorted({h.weight_version for h in healths if h.ready and h.weight_version}))
                if ready:
                    speculative = next((h.speculative for h in healths if h.ready), "")  # one config, every replica
                    self._health = EngineHealth(ready=True, message=f"{ready} of {len(answers)} engine replicas ready",
                                                weight_version=version, speculative=speculative)  # fmt: skip
                else:
                    why = "; ".join(h.message for h in healths if h.message) or "no engine replica answered"
                    self._health = EngineHealth(ready=False, message=why)
            await asyncio.sleep(HEALTH_POLL_S)

    async def _gather(self, method: str, *args: Any, timeout: float = BROADCAST_TIMEOUT_S) -> list[Any]:
        """Every replica's answer to ``method(*args)`` (an exception for one that failed)."""
        response = self._handle.broadcast(method, *args)
        return await response.results_async(timeout_s=timeout, return_exceptions=True)


def _unavailable(exc: BaseException) -> EngineUnavailable:
    """A Ray error before any replica took a request, as the engine's typed refusal."""
    name = type(exc).__name__
    if name == "BackPressureError":
        return QueueFull(f"every engine replica is busy and Ray Serve's queue is full ({name})", retry_after=1.0)
    return ShuttingDown(f"no engine replica could take the request ({name}: {exc})", retry_after=1.0)


def _answered(answers: list[Any]) -> list[Any]:
    """Every replica's answer to a control call, or the first refusal (as the core raised it) or
    failure raised: the change has reached every replica, or the caller hears that it has not."""
    for answer in answers:
        if isinstance(answer, dict) and codec.REFUSED in answer:
            codec.raise_refusal(answer[codec.REFUSED])
    for answer in answers:
        if isinstance(answer, BaseException):
            raise ShuttingDown(f"an engine replica did not apply the change ({type(answer).__name__}: {answer})")
    return answers


def _slept(answers: list[Any]) -> SleepState:
    """The replicas' sleep states as one: asleep in a part any replica sleeps in, settled once every one has."""
    states = [codec.decode_sleep(a) for a in _answered(answers)]
    asleep = {t for s in states for t in s.asleep}
    return SleepState(max(s.level for s in states), tuple(t for t in WAKE_TAGS if t in asleep),
                      all(s.settled for s in states))  # fmt: skip


def _joined(answers: list[Any]) -> PauseState:
    """The replicas' pause states as one: settled once every replica has settled."""
    states = [codec.decode_pause(a) for a in _answered(answers)]
    return PauseState(states[0].mode, all(s.settled for s in states), sum(s.held for s in states))


def add_stats(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' stats as one engine's: counts added up, the rest from the first replica."""
    total: dict[str, Any] = {}
    for stats in answers:
        for key, value in stats.items():
            if isinstance(value, list) and isinstance(total.get(key), list):  # per position: added position by position
                total[key] = [a + b for a, b in zip(total[key], value)]
            elif key in _NOT_ADDED or not isinstance(value, (int, float)) or isinstance(value, bool):
                total.setdefault(key, value)
            else:
                total[key] = total.get(key, 0) + value
    total["replicas"] = len(answers)
    return total
