"""SSE framing: chunks become `data:` events; an error mid-stream is one error event, then [DONE]."""

from __future__ import annotations

import json

from gyrfalcon.api.sse import DONE, EventStream as events
from gyrfalcon.errors import RequestError


def decode(frames):
    return [f.decode() for f in frames]


def test_chunks_then_done():
    frames = decode(events(iter([{"a": 1}, {"b": "é"}])))
    assert frames == ['data: {"a":1}\n\n', 'data: {"b":"é"}\n\n', DONE.decode()]


def test_error_mid_stream_is_one_event_then_done():
    closed = []

    def chunks():
        try:
            yield {"a": 1}
            raise RequestError("engine went away", None, status=503)
        finally:
            closed.append(True)

    frames = decode(events(chunks()))
    assert frames[0] == 'data: {"a":1}\n\n' and frames[-1] == DONE.decode() and len(frames) == 3
    error = json.loads(frames[1][len("data: "):])
    assert error == {"error": {"message": "engine went away", "type": "ServiceUnavailableError", "param": None, "code": 503}}
    assert closed == [True]


def test_unexpected_exception_is_a_500_event_not_a_broken_stream():
    def chunks():
        yield {"a": 1}
        raise ValueError("boom")

    frames = decode(events(chunks()))
    assert json.loads(frames[1][len("data: "):])["error"]["code"] == 500 and frames[-1] == DONE.decode()


def test_client_disconnect_closes_the_chunk_source():
    closed = []

    def chunks():
        try:
            while True:
                yield {"a": 1}
        finally:
            closed.append(True)

    gen = events(chunks())
    next(gen)
    gen.close()  # what the WSGI server does when the client hangs up
    assert closed == [True]


def test_close_before_the_first_event_still_closes_the_source():
    """A client that hangs up before the first event: the chunk source is closed all the same."""
    closed = []

    class Source:
        def __iter__(self):
            return self

        def __next__(self):
            return {"a": 1}

        def close(self):
            closed.append(True)

    events(Source()).close()
    assert closed == [True]
