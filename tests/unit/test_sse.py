"""SSE framing: chunks become `data:` events; an error mid-stream is one error event, then [DONE]."""

from __future__ import annotations

import asyncio
import json

from gyrfalcon.api.sse import DONE, EventStream as events
from gyrfalcon.errors import Kind, RequestError


class Source:
    """An async chunk source with the ``close()`` the serving runner's responses have."""

    def __init__(self, items, then=None):
        self.items = list(items)
        self.then = then
        self.closed = []

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.then is not None:
            raise self.then
        raise StopAsyncIteration

    async def close(self):
        self.closed.append(True)


def frames_of(stream) -> list[str]:
    async def collect():
        return [frame.decode() async for frame in stream]

    return asyncio.run(collect())


def test_chunks_then_done():
    source = Source([{"a": 1}, {"b": "é"}])
    assert frames_of(events(source)) == ['data: {"a":1}\n\n', 'data: {"b":"é"}\n\n', DONE.decode()]
    assert source.closed  # a finished stream closes its source too


def test_error_mid_stream_is_one_event_then_done():
    source = Source([{"a": 1}], then=RequestError("engine went away", None, type=Kind.SHUTTING_DOWN))
    frames = frames_of(events(source))
    assert frames[0] == 'data: {"a":1}\n\n' and frames[-1] == DONE.decode() and len(frames) == 3
    error = json.loads(frames[1][len("data: "):])
    assert error == {"error": {"message": "engine went away", "type": "server_shutting_down", "param": None, "code": 503}}
    assert source.closed


def test_unexpected_exception_is_a_500_event_not_a_broken_stream():
    frames = frames_of(events(Source([{"a": 1}], then=ValueError("boom"))))
    assert json.loads(frames[1][len("data: "):])["error"]["code"] == 500 and frames[-1] == DONE.decode()


def test_client_disconnect_closes_the_chunk_source():
    source = Source([{"a": 1}] * 100)

    async def read_one_then_close():
        stream = events(source)
        await stream.__anext__()
        await stream.close()  # what Falcon does however the response ends

    asyncio.run(read_one_then_close())
    assert source.closed


def test_close_before_the_first_event_still_closes_the_source():
    """A client that hangs up before the first event: the chunk source is closed all the same."""
    source = Source([{"a": 1}] * 100)
    asyncio.run(events(source).close())
    assert source.closed
