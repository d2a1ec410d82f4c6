"""The engine process's side: one ROUTER socket serving an :class:`EngineCore` to every API worker.

One thread (the caller of :meth:`EngineServer.serve`) owns the socket: it takes the workers'
messages, sends the heartbeats, and sends the outputs the core's step loop produced, batched per
worker. The step loop never touches the socket: a stream's waker only notes which request has
something new (:class:`~gyrfalcon.engine_process.wakeup.PollWakeup`). A submit prepares the
request (a grammar's compile: the API worker validated it) and may take a while, and the workers take 3 s
without a heartbeat for the engine's death — one slow submit on the socket's thread cut every open
stream; one on a single submitting thread held every request behind it. So submits run on a few
threads of their own (:data:`SUBMIT_THREADS`), aborts and finished choices on one thread in the
order they came — each after its own request's submit — and a submit's answer comes back to the
socket's thread the way outputs do.
"""

from __future__ import annotations

import concurrent.futures
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
from gyrfalcon.errors import Kind

log = logging.getLogger(__name__)

#: the wake-up key of a submit the core has answered
_SUBMITTED = "submitted"
#: the wake-up key of a core call that has its reply
_CALLED = "called"
#: submits validated at once: a request waits behind a slow submit (a large grammar's compile) only
#: when this many are slow together
SUBMIT_THREADS = 4


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
        #: the core's aborts and finishes, in arrival order (None: stop); the submits it answered
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._submitted: queue.SimpleQueue[tuple[bytes, Any, str, Any]] = queue.SimpleQueue()
        #: the replies of core calls made by name, to send
        self._called: queue.SimpleQueue[tuple[bytes, Any, Any]] = queue.SimpleQueue()
        self._core_calls = threading.Thread(target=self._run_jobs, name="gyrfalcon-core-calls", daemon=True)
        self._core_calls.start()
        self._submits = concurrent.futures.ThreadPoolExecutor(SUBMIT_THREADS, thread_name_prefix="gyrfalcon-submit")
        #: the engine ids whose submit still runs, each with the calls for it that came meanwhile
        self._pending: dict[str, list[tuple[Any, ...]]] = {}
        self._pending_lock = threading.Lock()

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
                    # wake on time for the next beat, not a whole beat later
                    events = dict(poller.poll(max(next_beat - time.monotonic(), 0.0) * 1000))
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
            self._submits.shutdown(wait=False, cancel_futures=True)
            self._jobs.put(None)
            self._core_calls.join(timeout=5.0)
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
            with self._pending_lock:
                self._pending.setdefault(self._engine_id(worker.identity, request[0]), [])
            self._submits.submit(self._submit, worker.identity, call_id, request)
        elif kind == b"abort":
            self._call(self.core.abort, self._engine_id(worker.identity, data[0]))
        elif kind == b"finish":
            request_id, index, stop_reason = data
            self._call(self.core.finish_choice, self._engine_id(worker.identity, request_id), index, stop_reason)
        elif kind == b"call":
            call_id, name, args = data
            self._submits.submit(self._run_call, worker.identity, call_id, name, args)
        elif kind == b"hello":
            info = self.core.info()
            self._send(worker.identity, b"info", [codec.encode_info(info), codec.encode_health(self.core.health()),
                                                 os.getpid()])  # fmt: skip
        elif kind == b"bye":
            self._forget(worker, "left")
        # b"ping": last_seen is all it carries

    @staticmethod
    def _engine_id(identity: bytes, request_id: str) -> str:
        """The core's id of a worker's request (ids are the workers' own: two may use the same)."""
        return f"{identity.decode(errors='replace')}:{request_id}"

    def _call(self, call: Any, engine_id: str, *arguments: Any) -> None:
        """``call(engine_id, *arguments)`` on the core, in the order the messages came, and after
        the request's own submit where that still runs."""
        with self._pending_lock:
            waiting = self._pending.get(engine_id)
            if waiting is not None:
                waiting.append((call, engine_id, *arguments))
                return
        self._jobs.put((call, engine_id, *arguments))

    def _run_jobs(self) -> None:
        """The core-calls thread: aborts and finishes, in the order the messages came."""
        while (job := self._jobs.get()) is not None:
            call, *arguments = job
            try:
                call(*arguments)
            except Exception:  # noqa: BLE001 - one bad message never stops the engine
                log.exception("engine call %s failed", getattr(call, "__name__", call))

    def _submit(self, identity: bytes, call_id: Any, data: list[Any]) -> None:
        """Submit to the core (the submitter thread); the socket's thread answers (:meth:`_answer`)."""
        engine_id = self._engine_id(identity, str(data[0]))
        try:
            request = codec.decode_request(data)
            local_id = request.request_id
            request.request_id = engine_id
            result: Any = self.core.submit(request)
        except Exception as exc:  # noqa: BLE001 - a refusal travels back to the worker
            local_id, result = "", exc
        finally:
            with self._pending_lock:
                for job in self._pending.pop(engine_id, []):  # what came for it meanwhile, in order
                    self._jobs.put(job)
        self._submitted.put((identity, call_id, local_id, result))
        self._ready.notify(_SUBMITTED)

    def _run_call(self, identity: bytes, call_id: Any, name: str, args: list[Any]) -> None:
        """The core's ``name(*args)`` (a submitter thread: new weights take seconds to load, and the
        socket's thread sends the heartbeats); the socket's thread sends the reply."""
        try:
            if name not in codec.CORE_CALLS:
                raise RuntimeError(f"no core call {name!r}")
            reply = [None, codec.encode_result(getattr(self.core, name)(*args))]
        except Exception as exc:  # noqa: BLE001 - the refusal travels back to the caller
            reply = [codec.encode_refusal(exc), None]
        self._called.put((identity, call_id, reply))
        self._ready.notify(_CALLED)

    def _answer(self) -> None:
        """Reply to the submits the core has taken or refused; an accepted one's stream is the
        worker's from now on (its outputs flushed as they come), or aborted if the worker is gone."""
        while True:
            try:
                identity, call_id, local_id, result = self._submitted.get_nowait()
            except queue.Empty:
                return
            if isinstance(result, Exception):
                self._send(identity, b"reply", [call_id, codec.encode_refusal(result)])
                continue
            worker = self._workers.get(identity)
            if worker is None:  # it left (or died) while its request was being submitted
                result.close()
                self.core.abort(self._engine_id(identity, local_id))
                continue
            worker.streams[local_id] = result
            key = (identity, local_id)
            result.set_waker(lambda key=key: self._ready.notify(key))
            self._ready.notify(key)  # an output may have come before the waker was set
            self._send(identity, b"reply", [call_id, None])

    def _flush(self, keys: list[Any]) -> None:
        """Answer the submits done meanwhile, then send every ready stream's outputs, one message per worker."""
        if _SUBMITTED in keys:
            self._answer()
        if _CALLED in keys:
            while not self._called.empty():
                identity, call_id, reply = self._called.get_nowait()
                self._send(identity, b"reply", [call_id, reply])
        batches: dict[bytes, list[Any]] = {}
        for key in set(keys):
            if key is None or key in (_SUBMITTED, _CALLED):
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
            self.core.abort(self._engine_id(worker.identity, local_id))
        error = EngineError(message, type=ShuttingDown.type if unavailable else Kind.ENGINE_FAILED,
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
