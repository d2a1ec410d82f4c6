"""A client that hangs up is noticed, and its sequences are freed in the engine; one that only
half-closes its socket still gets its answer."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from gyrfalcon.api.connection import Connection
from gyrfalcon.api.errors import http_status
from gyrfalcon.api.protocol import ConnectionLimits
from gyrfalcon.config import Settings
from gyrfalcon.errors import Kind, RequestError
from gyrfalcon.protocol.translate import Translator
from gyrfalcon.serving.runner import complete, submit_all
from tests.helpers import ServedInThread, served_app


def receiver(*messages, then_wait: asyncio.Event | None = None):
    """An ASGI receive that returns ``messages``, then (once ``then_wait`` is set) http.disconnect."""
    queue = list(messages)

    async def receive():
        if queue:
            return queue.pop(0)
        if then_wait is not None:
            await then_wait.wait()
        return {"type": "http.disconnect"}

    return receive


def test_a_connection_reports_a_disconnect_to_its_listeners():
    async def scenario():
        leave = asyncio.Event()
        connection = Connection(receiver({"type": "http.request", "body": b"{}", "more_body": False}, then_wait=leave))
        assert (await connection.receive())["type"] == "http.request"
        heard = []
        connection.add_listener(lambda: heard.append("gone"))
        connection.watch()
        await asyncio.sleep(0.01)
        assert not connection.is_set() and heard == []
        leave.set()
        await asyncio.sleep(0.01)
        assert connection.is_set() and heard == ["gone"]
        late = []
        connection.add_listener(lambda: late.append("gone"))  # a listener added after: called at once
        assert late == ["gone"]
        connection.close()

    asyncio.run(scenario())


def test_gone_client_aborts_its_request(tiny_engine):
    translator = Translator(tiny_engine, ["tiny"], {})
    serving = translator.translate("completions", {"prompt": "x", "max_tokens": 100, "n": 4, "ignore_eos": True, "seed": 1})
    before = tiny_engine.stats()["requests_aborted"]
    streams = submit_all(tiny_engine, serving)
    started = time.monotonic()

    async def scenario():
        connection = Connection(receiver())  # the client is already gone
        connection.watch()
        await complete(tiny_engine, serving, streams, connection)

    with pytest.raises(RequestError) as info:
        asyncio.run(scenario())
    assert info.value.type == Kind.CLIENT_CLOSED and http_status(info.value) == 499
    deadline = time.monotonic() + 10
    while tiny_engine.stats()["requests_aborted"] == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tiny_engine.stats()["requests_aborted"] == before + 1
    assert time.monotonic() - started < 10


def raw_post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
            .encode() + data)  # fmt: skip


def read_all(sock: socket.socket, timeout: float = 60) -> bytes:
    sock.settimeout(timeout)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.fixture
def served(app):
    with ServedInThread(app, ConnectionLimits(probe_interval=0.2)) as url:
        yield int(url.rsplit(":", 1)[1])


def test_a_half_closed_client_still_gets_its_answer(served):
    for stream in (False, True):
        with socket.create_connection(("127.0.0.1", served)) as sock:
            sock.sendall(raw_post("/v1/completions", {"prompt": "Hello", "max_tokens": 30, "temperature": 0,
                                                      "ignore_eos": True, "stream": stream}))  # fmt: skip
            sock.shutdown(socket.SHUT_WR)  # done sending; still reading
            raw = read_all(sock)
        head, _, body = raw.rpartition(b"\r\n\r\n") if not stream else raw.partition(b"\r\n\r\n200")
        final = raw.split(b"HTTP/1.1 ")[-1]  # informational 100s may come first
        assert final.startswith(b"200 OK"), raw[:300]
        if stream:
            assert b"data: [DONE]" in raw and b'"finish_reason":"length"' in raw
        else:
            assert json.loads(final.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 30


@pytest.mark.parametrize("slow_engine", [0.02], indirect=True)
def test_a_client_that_closes_its_socket_aborts_its_non_streaming_request(slow_engine, tiny_model_dir):
    app = served_app(slow_engine, Settings(model=tiny_model_dir, served_model_name=["tiny"]))
    with ServedInThread(app, ConnectionLimits(probe_interval=0.2)) as url:
        port = int(url.rsplit(":", 1)[1])
        before = slow_engine.stats()["requests_aborted"]
        started = time.monotonic()
        leave_and_wait_for_the_abort(port, slow_engine, before)
    assert time.monotonic() - started < 3  # 240 steps of 20 ms would take 5 s


def leave_and_wait_for_the_abort(port, engine, before):
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(raw_post("/v1/completions", {"prompt": "Hello", "max_tokens": 240, "temperature": 1.0,
                                              "ignore_eos": True, "n": 2}))  # fmt: skip
    time.sleep(0.3)
    sock.close()  # gone for good: the next bytes the server writes get a reset
    deadline = time.monotonic() + 20
    while engine.stats()["requests_aborted"] == before:
        assert time.monotonic() < deadline, "the request ran on for a client that had left"
        time.sleep(0.05)
