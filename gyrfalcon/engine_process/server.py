"""The engine process's side: one ROUTER socket serving an :class:`EngineCore` to every API worker.

One thread (the caller of :meth:`EngineServer.serve`) owns the socket: it takes the workers'
messages, submits and aborts in the core, and sends the outputs the core's step loop produced,
batched per worker. The step loop never touches the socket: a stream's waker only notes which
request has something new (:class:`~gyrfalcon.engine_process.wakeup.PollWakeup`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from typing import Any

import zmq

from gyrfalcon.engine_api import codec
from gyrfalcon.engine_api.errors import ShuttingDown
from gyrfalcon.engine_api.interface import EngineCore, OutputStream
from gyrfalcon.engine_api.types import EngineError, RequestOutput
from gyrfalcon.engine_process import BEAT_S, SILENCE_S
from gyrfalcon.engine_process.wakeup import PollWakeup

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Worker:
    identity: bytes
    last_seen: float
    #: the worker's request id → the core's stream
    streams: dict[str, OutputStream] = dataclasses.field(default_factory=dict)


class EngineServer:
    """Serves ``core`` at ``address`` (a ZeroMQ endpoint, ``ipc://…`` here) until stopped.

    A worker silent for ``silence_s`` seconds (killed, hung) has its requests aborted in the core.
    With ``parent_pid``, the server also stops when that process is gone (its launcher was killed).
    """

    def __init__(self, core: EngineCore, address: str, *, silence_s: float = SILENCE_S,
                 parent_pid: int | None = None) -> None:  # fmt: skip
        self.core = core
        self.silence_s = silence_s
        self.parent_pid = parent_pid
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        for option in (zmq.SNDHWM, zmq.RCVHWM):  # never drop an output: a worker reads all it is sent
            self._socket.setsockopt(option, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._workers: dict[bytes, _Worker] = {}
        self._ready = PollWakeup()
        self._stop = threading.Event()
        self._draining = False

    # ------------------------------------------------------------------ control (any thread)

    def stop(self) -> None:
        """End :meth:`serve` (thread- and signal-safe)."""
        self._stop.set()
        self._ready.notify(None)

    def drain(self, timeout: float) -> None:
        """The server stops: the core drains (see ``EngineCore.drain``), once."""
        if not self._draining:
            self._draining = True
            threading.Thread(target=self.core.drain, args=(timeout,), name="gyrfalcon-drain", daemon=True).start()

    # ------------------------------------------------------------------ the loop

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._ready.fd, zmq.POLLIN)
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                try:
                    events = dict(poller.poll(BEAT_S * 1000))
                    if self._socket in events:
                        self._receive()
                    if self._ready.fd in events:
                        self._flush(self._ready.take())
                    now = time.monotonic()
                    if now >= next_beat:
                        next_beat = now + BEAT_S
                        self._receive()  # what waits in the socket counts before anyone is called silent
                        self._beat(time.monotonic())
                except Exception:  # noqa: BLE001 - the engine outlives any one bad message or output
                    log.exception("engine server loop")
        finally:
            self._abort_all()
            self._socket.close(linger=0)
            self._context.term()
            self._ready.close()

    def _send(self, identity: bytes, kind: bytes, payload: Any) -> None:
        try:
            self._socket.send_multipart([identity, kind, codec.pack(payload)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # the worker is gone: what it was sent no longer matters
            pass

    def _receive(self) -> None:
        while True:
            try:
                identity, kind, payload = self._socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not our framing: ignored
                continue
            worker = self._workers.get(identity)
            if worker is None:
                if kind == b"bye":
                    continue
                if kind != b"hello":  # a worker this engine forgot (taken for dead): it must drop what it holds
                    self._send(identity, b"reset", None)
                worker = self._workers[identity] = _Worker(identity, time.monotonic())
                log.info("API worker %s connected", identity.decode(errors="replace"))
            worker.last_seen = time.monotonic()
            try:
                self._handle(worker, kind, codec.unpack(payload) if payload else None)
            except Exception as exc:  # noqa: BLE001 - one bad message never stops the engine
                log.exception("engine message %r from %r failed", kind, identity)
                if kind in (b"submit", b"call"):  # the caller waits for an answer: give it one
                    try:
                        self._send(identity, b"reply", [codec.unpack(payload)[0], codec.encode_refusal(exc)])
                    except Exception:  # noqa: BLE001 - an unreadable message: the caller times out
                        pass

    def _handle(self, worker: _Worker, kind: bytes, data: Any) -> None:
        if kind == b"submit":
            call_id, request = data
            self._send(worker.identity, b"reply", [call_id, self._submit(worker, request)])
        elif kind == b"abort":
            self.core.abort(self._engine_id(worker, data[0]))
        elif kind == b"finish":
            request_id, index, stop_reason = data
            self.core.finish_choice(self._engine_id(worker, request_id), index, stop_reason)
        elif kind == b"call":
            call_id, name, _args = data
            if name == "stats":
                self._send(worker.identity, b"reply", [call_id, [None, self.core.stats()]])
        elif kind == b"hello":
            info = self.core.info()
            self._send(worker.identity, b"info", [codec.encode_info(info), codec.encode_health(self.core.health()),
                                                 os.getpid()])  # fmt: skip
        elif kind == b"bye":
            self._forget(worker, "left")
        # b"ping": last_seen is all it carries

    @staticmethod
    def _engine_id(worker: _Worker, request_id: str) -> str:
        return f"{worker.identity.decode(errors='replace')}:{request_id}"

    def _submit(self, worker: _Worker, data: list[Any]) -> list[Any] | None:
        """None when accepted, else the refusal."""
        request = codec.decode_request(data)
        local_id = request.request_id
        request.request_id = self._engine_id(worker, local_id)
        try:
            stream = self.core.submit(request)
        except Exception as exc:  # noqa: BLE001 - a refusal travels back to the worker
            return codec.encode_refusal(exc)
        worker.streams[local_id] = stream
        key = (worker.identity, local_id)
        stream.set_waker(lambda: self._ready.notify(key))
        self._ready.notify(key)  # an output may have come before the waker was set
        return None

    def _flush(self, keys: list[Any]) -> None:
        """Send every ready stream's outputs, one message per worker."""
        batches: dict[bytes, list[Any]] = {}
        for key in set(keys):
            if key is None:
                continue
            identity, local_id = key
            worker = self._workers.get(identity)
            stream = worker.streams.get(local_id) if worker is not None else None
            if stream is None:
                continue
            batch = batches.setdefault(identity, [])
            while True:
                try:
                    output = stream.get(timeout=0)
                except queue.Empty:
                    break
                if output is None:
                    batch.append([local_id, None])
                    del worker.streams[local_id]
                    break
                try:
                    batch.append([local_id, codec.encode_output(output)])
                except Exception as exc:  # noqa: BLE001 - e.g. a plugin's value msgpack cannot carry
                    log.exception("output of %s cannot be sent", local_id)
                    self._end(worker, local_id, f"internal error: the output cannot be sent: {exc}", batch)
                    break
        for identity, batch in batches.items():
            if batch:
                self._send(identity, b"out", batch)

    def _beat(self, now: float) -> None:
        health = codec.encode_health(self.core.health())
        for worker in list(self._workers.values()):
            if now - worker.last_seen > self.silence_s:
                self._forget(worker, f"silent for {now - worker.last_seen:.1f} s")
            else:
                self._send(worker.identity, b"beat", [health])
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.warning("the process that started the engine is gone: stopping")
            self._stop.set()

    def _end(self, worker: _Worker, local_id: str, message: str, batch: list[Any], unavailable: bool = False) -> None:
        """End one of ``worker``'s streams with an error (appended to ``batch``) and abort its request;
        ``unavailable``: the engine dropped it, and a retry may succeed."""
        stream = worker.streams.pop(local_id, None)
        if stream is not None:
            stream.set_waker(None)
            self.core.abort(self._engine_id(worker, local_id))
        error = EngineError(message, type=ShuttingDown.type if unavailable else "server_error",
                            retry_after=1.0 if unavailable else None)  # fmt: skip
        batch += [[local_id, codec.encode_output(RequestOutput(local_id, [], finished=True, error=error))], [local_id, None]]

    def _forget(self, worker: _Worker, why: str) -> None:
        """A worker left or died: abort its requests (and, should it still be there, end its streams
        with a 503 so that none of its clients waits for outputs that will not come)."""
        self._workers.pop(worker.identity, None)
        name = worker.identity.decode(errors="replace")
        if worker.streams:
            log.warning("API worker %s %s: aborting its %d requests", name, why, len(worker.streams))
        else:
            log.info("API worker %s %s", name, why)
        batch: list[Any] = []
        for local_id in list(worker.streams):
            self._end(worker, local_id, f"the engine dropped this API worker's requests: it was {why}", batch, unavailable=True)
        if batch:
            self._send(worker.identity, b"out", batch)

    def _abort_all(self) -> None:
        for worker in list(self._workers.values()):
            self._forget(worker, "dropped: the engine stops")
