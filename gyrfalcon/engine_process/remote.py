"""The API worker's side: :class:`RemoteEngineCore`, the engine process behind the ``EngineCore`` API.

One thread owns the worker's DEALER socket: callers' messages reach it through a queue and a
wake-up pipe, and it puts the engine's outputs into each request's stream (whose waker wakes the
request's asyncio task). ``submit`` waits for the engine's answer, so a refusal is still raised
before the API commits a status.

The engine's heartbeat carries its health; silence for ``SILENCE_S`` seconds, or the connection
closing, means the engine process is gone: every open stream ends at once with a 503 error,
``/health`` answers 503, and new requests are refused (the launcher stops the server, whose
supervisor restarts it).
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
import uuid
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from gyrfalcon.engine_api import codec
from gyrfalcon.engine_api.errors import SHUTTING_DOWN, EngineUnavailable, ShuttingDown
from gyrfalcon.engine_api.interface import EngineCore, OutputStream
from gyrfalcon.engine_api.streams import CoalescingOutputStream
from gyrfalcon.engine_api.types import (EngineError, EngineHealth, EngineInfo, EngineRequest, PauseState, RequestOutput,
                                       SleepState)  # fmt: skip
from gyrfalcon.engine_process import BEAT_S, SILENCE_S
from gyrfalcon.engine_process.wakeup import PollWakeup
from gyrfalcon.errors import RequestError

log = logging.getLogger(__name__)

#: seconds a worker waits for the engine to answer its hello (the engine answers while it loads)
CONNECT_TIMEOUT_S = 120.0
#: seconds a submit waits for the engine's answer (then a 503)
CALL_TIMEOUT_S = 30.0
#: seconds a stats call waits (then /metrics shows the request metrics without the engine's)
STATS_TIMEOUT_S = 5.0
#: seconds an update of the weights may take (loading and checking them, then the step loop's copy)
WEIGHTS_CALL_TIMEOUT_S = 600.0

ENGINE_GONE = "the engine process is gone"


class _Call:
    """A call waiting for the engine's reply."""

    __slots__ = ("done", "value")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None


class RemoteEngineCore(EngineCore):
    """An :class:`EngineCore` in another process, at ``address`` (see the package docstring).

    ``identity`` names this worker to the engine (default: ``w<pid>-<random>``); the engine runs
    each request as ``<identity>:<request id>`` and aborts a silent worker's requests.
    """

    def __init__(self, address: str, *, identity: str | None = None, connect_timeout: float = CONNECT_TIMEOUT_S,
                 silence_s: float = SILENCE_S) -> None:  # fmt: skip
        self.address = address
        self.identity = identity or f"w{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.silence_s = silence_s
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, self.identity.encode())
        for option in (zmq.SNDHWM, zmq.RCVHWM):  # never drop an abort or a stop: they are small and few
            self._socket.setsockopt(option, 0)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._socket.connect(address)
        self._streams: dict[str, OutputStream] = {}
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count()
        self._outbox: collections.deque[list[bytes]] = collections.deque()
        self._wake = PollWakeup()
        self._lock = threading.Lock()
        self._gone: str | None = None
        self._draining = False
        self._stop = threading.Event()
        self._info, self._health, self.engine_pid = self._hello(connect_timeout)
        self._last_heard = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="gyrfalcon-engine-link", daemon=True)
        self._thread.start()

    def _hello(self, timeout: float) -> tuple[EngineInfo, EngineHealth, int]:
        self._socket.send_multipart([b"hello", b""])
        if not self._socket.poll(timeout * 1000, zmq.POLLIN):
            self._close_sockets()
            raise ConnectionError(f"no engine answered at {self.address} within {timeout:.0f} s")
        while True:
            kind, payload = self._socket.recv_multipart()
            if kind == b"info":
                info, health, pid = codec.unpack(payload)
                return codec.decode_info(info), codec.decode_health(health), pid

    # ------------------------------------------------------------------ EngineCore

    def info(self) -> EngineInfo:
        return self._info

    def health(self) -> EngineHealth:
        if self._gone is None and not self._thread.is_alive() and not self._stop.is_set():
            self._engine_gone("the link to the engine process failed")
        if self._gone is not None:
            return EngineHealth(ready=False, message=self._gone)
        if self._draining:
            return EngineHealth(ready=False, message="the server is shutting down")
        return self._health

    def submit(self, request: EngineRequest) -> OutputStream:
        if self._gone is not None:
            raise ShuttingDown(self._gone)
        if self._draining:
            raise ShuttingDown("the server is shutting down")
        stream = CoalescingOutputStream(request.request_id, request.output_kind, on_close=self.abort)
        with self._lock:
            if request.request_id in self._streams:
                raise RequestError(f"request id {request.request_id!r} is already running", "request_id")
            self._streams[request.request_id] = stream
        try:
            refusal = self._call(b"submit", codec.encode_request(request))
        except BaseException:
            self._drop(request.request_id)
            self.abort(request.request_id)  # in case the engine took it after all
            raise
        if refusal is not None:
            self._drop(request.request_id)
            codec.raise_refusal(refusal)
        return stream

    def abort(self, request_id: str) -> None:
        self._post(b"abort", [request_id])

    def finish_choice(self, request_id: str, index: int, stop_reason: str | int | None = None) -> None:
        self._post(b"finish", [request_id, index, stop_reason])

    def stats(self) -> dict[str, Any]:
        if self._gone is not None:
            return {}
        try:
            error, stats = self._call(b"call", "stats", [], timeout=STATS_TIMEOUT_S)
        except EngineUnavailable:
            return {}
        return stats if error is None else {}

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> PauseState:
        return codec.decode_pause(self._core_call("pause", mode, clear_cache))

    def resume(self) -> PauseState:
        return codec.decode_pause(self._core_call("resume"))

    def pause_state(self) -> PauseState:
        return codec.decode_pause(self._core_call("pause_state"))

    def abort_requests(self, group_ids: list[str] | None = None) -> int:
        return int(self._core_call("abort_requests", group_ids))

    def update_weights(self, model_path: str, weight_version: str | None = None, flush_cache: bool = True) -> str:
        return str(self._core_call("update_weights", model_path, weight_version, flush_cache,
                                   timeout=WEIGHTS_CALL_TIMEOUT_S))  # fmt: skip

    def sleep(self, level: int = 1) -> SleepState:
        return codec.decode_sleep(self._core_call("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> SleepState:
        return codec.decode_sleep(self._core_call("wake_up", tags, timeout=WEIGHTS_CALL_TIMEOUT_S))

    def sleep_state(self) -> SleepState:
        return codec.decode_sleep(self._core_call("sleep_state"))

    def load_lora_adapter(self, lora_name: str, lora_path: str, load_inplace: bool = False) -> None:
        self._core_call("load_lora_adapter", lora_name, lora_path, load_inplace, timeout=WEIGHTS_CALL_TIMEOUT_S)

    def unload_lora_adapter(self, lora_name: str) -> None:
        self._core_call("unload_lora_adapter", lora_name)

    def lora_adapters(self) -> list[list[str]]:
        return [list(pair) for pair in self._core_call("lora_adapters")]

    def _core_call(self, name: str, *arguments: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """The core's ``name(*arguments)`` in the engine process (:data:`codec.CORE_CALLS`): its
        result, or what it raised."""
        if self._gone is not None:
            raise ShuttingDown(self._gone)
        error, value = self._call(b"call", name, list(arguments), timeout=timeout)
        if error is not None:
            codec.raise_refusal(error)
        return value

    def drain(self, timeout: float) -> None:
        """This worker stops (the engine drains on its own signal, see ``gyrfalcon.engine_process``):
        new requests are refused, and those still open after ``timeout`` seconds end with a 503."""
        self._draining = True
        timer = threading.Timer(max(timeout, 0.0), self._cut, args=(SHUTTING_DOWN,))
        timer.daemon = True
        timer.start()

    def shutdown(self, grace: float = 5.0) -> None:
        deadline = time.monotonic() + max(grace, 0.0)
        while self._streams and time.monotonic() < deadline and self._gone is None:
            time.sleep(0.01)
        self._cut(EngineError("the server shut down", type=ShuttingDown.type, retry_after=1.0))
        self._post(b"bye", None)  # the engine aborts what is left of ours
        self._stop.set()
        self._wake.notify()
        self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------ callers' side

    def _post(self, kind: bytes, data: Any) -> None:
        self._outbox.append([kind, codec.pack(data)])
        self._wake.notify()

    def _call(self, kind: bytes, *data: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        call = _Call()
        call_id = next(self._call_ids)
        self._calls[call_id] = call
        try:
            if self._gone is not None:  # gone between the caller's check and now: no answer will come
                raise ShuttingDown(self._gone)
            self._post(kind, [call_id, *data])
            if not call.done.wait(timeout):
                raise EngineUnavailable(f"the engine did not answer within {timeout:.0f} s")
        finally:
            self._calls.pop(call_id, None)
        if call.value is _GONE:
            raise ShuttingDown(self._gone or ENGINE_GONE)
        return call.value

    def _drop(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def _cut(self, error: EngineError) -> None:
        """End every open stream with ``error`` and abort its request in the engine."""
        with self._lock:
            streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            stream.put(RequestOutput(request_id, [], finished=True, error=error))
            stream.finish()
            self._post(b"abort", [request_id])

    # ------------------------------------------------------------------ the socket's thread

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake.fd, zmq.POLLIN)
        next_ping = 0.0
        try:
            while not self._stop.is_set():
                try:
                    # wake on time for the next ping, not a whole beat later
                    events = dict(poller.poll(max(next_ping - time.monotonic(), 0.0) * 1000))
                    if self._wake.fd in events:
                        self._wake.take()
                    self._send_outbox()
                    if self._socket in events:
                        self._receive()
                    if self._monitor in events and self._disconnected():
                        self._engine_gone(f"{ENGINE_GONE}: its connection closed")
                    now = time.monotonic()
                    if now >= next_ping:
                        next_ping = now + BEAT_S
                        self._outbox.append([b"ping", b""])
                        self._send_outbox()  # now, not after the next poll: that may wait a whole beat
                        self._receive()  # what waits in the socket counts before the engine is called silent
                        silent = time.monotonic() - self._last_heard
                        if self._gone is None and silent > self.silence_s:
                            self._engine_gone(f"{ENGINE_GONE}: silent for {silent:.1f} s")
                except Exception:  # noqa: BLE001 - one bad message never ends the link
                    log.exception("engine link")
            self._send_outbox()
        except BaseException:
            self._engine_gone("the link to the engine process failed")
            raise
        finally:
            self._close_sockets()

    def _send_outbox(self) -> None:
        while self._outbox:
            frames = self._outbox.popleft()
            try:
                self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # no engine to take it: the heartbeat tells the rest
                pass

    def _receive(self) -> None:
        while True:
            try:
                kind, payload = self._socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue
            self._last_heard = time.monotonic()
            data = codec.unpack(payload)
            if kind == b"out":
                self._deliver(data)
            elif kind == b"reply":
                call = self._calls.get(data[0])
                if call is not None:
                    call.value = data[1]
                    call.done.set()
            elif kind == b"reset":  # the engine took this worker for dead and dropped its requests
                self._cut(EngineError("the engine dropped this request (it lost contact with this worker)",
                                      type=ShuttingDown.type, retry_after=1.0))  # fmt: skip
            elif kind == b"beat":
                self._health = codec.decode_health(data[0])
                if self._health.decode_path and self._info.decode_path != self._health.decode_path:
                    self._info.decode_path = self._health.decode_path  # known once the engine has loaded
                if self._gone is not None:
                    log.warning("the engine answers again")
                    self._gone = None

    def _deliver(self, batch: list[Any]) -> None:
        for request_id, output in batch:
            stream = self._streams.get(request_id)
            if stream is None:  # cut here already
                continue
            if output is None:
                self._drop(request_id)
                stream.finish()
            else:
                stream.put(codec.decode_output(request_id, output))

    def _disconnected(self) -> bool:
        gone = False
        while True:
            try:
                event = recv_monitor_message(self._monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return gone
            gone = gone or event["event"] == zmq.EVENT_DISCONNECTED

    def _engine_gone(self, why: str) -> None:
        if self._gone is not None:
            return
        log.error("%s: its %d open requests end with a 503", why, len(self._streams))
        self._gone = why
        for call in list(self._calls.values()):
            call.value = _GONE
            call.done.set()
        self._cut(EngineError(why, type=ShuttingDown.type, retry_after=1.0))

    def _close_sockets(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=200)  # time for the goodbye and the last aborts to leave
        self._context.term()
        self._wake.close()


_GONE = object()
