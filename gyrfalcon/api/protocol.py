"""uvicorn's HTTP/1.1 protocol (httptools) with the guards it lacks against slow and broken clients.

uvicorn closes an idle keep-alive connection, but it waits forever for a request's head, buffers
headers without bound, lets a client that reads nothing hold its response, closes a half-closed
socket before answering, and answers its own parse errors in plain text. Here:

- a request's line and headers must arrive within ``header_timeout`` (a 408, then close), and stay
  under ``max_head_bytes`` (a 431) with a URL under ``max_url_bytes`` (a 414);
- a response whose writes stay paused (the client reads nothing) for ``send_timeout`` drops the
  connection, which the app sees as a disconnect and aborts the work;
- a client that half-closes (shuts down its sending side) after its request still gets its answer;
  while a non-streaming answer is pending, ``100 Continue`` (which every HTTP/1.1 client skips) is
  written once a second, so a client that really went away resets the connection and the work is
  aborted instead of running to its end;
- the server's own errors are the API's JSON error envelope;
- when the worker stops, a TLS connection it closes is cut after ``tls_close_grace`` if the client
  has not answered TLS's closing message (asyncio and uvloop wait 30 s for that answer, which a
  client holding an idle keep-alive connection never sends, and a stopping worker waits for every
  connection: a server behind HTTPS took 20 s to stop after one request).
"""

from __future__ import annotations

import asyncio
import dataclasses
import http
import logging
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gyrfalcon.api.errors import error_body

log = logging.getLogger("gyrfalcon.api")

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may cost: seconds, bytes (see the module docstring)."""

    header_timeout: float = 20.0
    send_timeout: float = 30.0
    max_head_bytes: int = 32 * 1024
    max_url_bytes: int = 8 * 1024
    #: how often a half-closed client's pending answer is probed
    probe_interval: float = 1.0
    #: how long a stopping worker's TLS connection, once closed, may wait for the client's close_notify
    tls_close_grace: float = 1.0


def error_response(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 response carrying the error envelope; the connection closes after it."""
    body = orjson.dumps(error_body(status, message))
    head = (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` with the guards of the module docstring."""

    def __init__(self, *args: Any, limits: ConnectionLimits = ConnectionLimits(), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._head_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._probe_timer: asyncio.TimerHandle | None = None
        self._close_timer: asyncio.TimerHandle | None = None
        self._reading_head = True  # waiting for a request's line and headers (the head timer runs)
        self._in_head = False  # the parser is inside a head: its bytes count against the limit
        self._head_bytes = 0
        self._peer_eof = False
        self._rejected = False
        self.url = b""

    # ------------------------------------------------------------------ a request's head

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._cancel("_head_timer")
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _responding(self) -> bool:
        """A request is being answered (or waits in the pipeline for its turn)."""
        return bool(self.pipeline) or (self.cycle is not None and not self.cycle.response_complete)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._reading_head or self._responding():
            return
        if not self._in_head:
            self.transport.close()  # nothing of a request came: nothing to answer
        else:
            self._reject(408, f"The request's headers did not arrive within {self.limits.header_timeout:g} s")

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return
        super().data_received(data)
        if self._in_head and not self._rejected:  # a head the parser has begun and not finished
            self._head_bytes += len(data)
            if len(self.url) > self.limits.max_url_bytes:
                self._reject(414, f"The request's URL exceeds {self.limits.max_url_bytes} bytes")
            elif self._head_bytes > self.limits.max_head_bytes + self.limits.max_url_bytes:
                self._reject(431, f"The request's line and headers exceed {self.limits.max_head_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True

    def on_headers_complete(self) -> None:
        if len(self.url) > self.limits.max_url_bytes:
            raise ValueError("URL too long")  # the parser stops; data_received answers the 414
        if sum(len(name) + len(value) + 4 for name, value in self.headers) > self.limits.max_head_bytes:
            raise ValueError("headers too large")
        self._reading_head = self._in_head = False
        self._head_bytes = 0
        self._cancel("_head_timer")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head = True  # a pipelined request may follow

    def on_response_complete(self) -> None:
        self._cancel("_probe_timer")
        super().on_response_complete()  # starts a pipelined request, if one waits
        if self._responding():
            return
        if self._peer_eof:  # the client sends nothing more: the connection is done
            self.transport.close()
        elif not self.transport.is_closing():
            self._arm_head_timer()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's parse errors (bad request line, bad header, bad chunk): the envelope, not text
        if len(self.url) > self.limits.max_url_bytes:
            self._reject(414, f"The request's URL exceeds {self.limits.max_url_bytes} bytes")
        elif self.headers and sum(len(n) + len(v) + 4 for n, v in self.headers) > self.limits.max_head_bytes:
            self._reject(431, f"The request's headers exceed {self.limits.max_head_bytes} bytes")
        else:
            self._reject(400, "Invalid HTTP request: the request line, a header or the body's framing is malformed")

    def _reject(self, status: int, message: str) -> None:
        """Answer ``status`` with the envelope and close; while a whole request is being answered
        (the bad bytes come after it), only stop reading: that answer ends, then the connection."""
        self._rejected = True
        self._cancel("_head_timer")
        cycle = self.cycle
        answering = cycle is not None and not cycle.response_complete and (
            cycle.response_started or not cycle.more_body or self.pipeline)
        if answering:
            cycle.keep_alive = False
            self.flow.pause_reading()
            return
        if not self.transport.is_closing():
            self.transport.write(error_response(status, message))
            self.transport.close()

    # ------------------------------------------------------------------ a client that reads nothing

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.send_timeout, self._send_timed_out)

    def resume_writing(self) -> None:
        self._cancel("_send_timer")
        super().resume_writing()

    def _send_timed_out(self) -> None:
        self._send_timer = None
        log.info("client %s read nothing for %g s: connection dropped", self.client, self.limits.send_timeout)
        self.transport.abort()  # connection_lost: the app sees a disconnect

    # ------------------------------------------------------------------ half-close

    def eof_received(self) -> bool | None:
        if self.cycle is None or self.cycle.response_complete:
            return None  # between requests: close
        self._peer_eof = True
        if not self.pipeline and not self.cycle.response_started and self.scope.get("http_version", "1.1") == "1.1":
            self._probe_timer = self.loop.call_later(self.limits.probe_interval, self._probe)
        return True  # keep the sending side open: the answer is still wanted

    def _probe(self) -> None:
        self._probe_timer = None
        cycle = self.cycle
        if (self.transport.is_closing() or cycle is None or cycle.response_started or cycle.response_complete
                or self.pipeline):  # while pipelined, ``self.cycle`` is not the one answering
            return
        self.transport.write(CONTINUE)  # a client that is gone answers with a reset
        self._probe_timer = self.loop.call_later(self.limits.probe_interval, self._probe)

    # ------------------------------------------------------------------ the worker stops

    def shutdown(self) -> None:
        super().shutdown()  # closes an idle connection now, a busy one after its response
        if self.transport.get_extra_info("sslcontext") is not None and self._close_timer is None:
            self._close_timer = self.loop.call_later(self.limits.tls_close_grace, self._cut_closed_tls)

    def _cut_closed_tls(self) -> None:
        self._close_timer = None
        if self.transport.is_closing():  # closed, still waiting for the client's close_notify
            self.transport.abort()
        else:  # a response still running: its own close comes first
            self._close_timer = self.loop.call_later(self.limits.tls_close_grace, self._cut_closed_tls)

    def connection_lost(self, exc: Exception | None) -> None:
        for name in ("_head_timer", "_send_timer", "_probe_timer", "_close_timer"):
            self._cancel(name)
        super().connection_lost(exc)

