"""Server-sent events under WSGI: ``resp.stream`` is a generator of ``data: ...`` frames."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import falcon
import orjson

from gyrfalcon.api.errors import error_body
from gyrfalcon.errors import RequestError

DONE = b"data: [DONE]\n\n"


def frame(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def events(chunks: Iterator[dict[str, Any]]) -> Iterator[bytes]:
    """Frame each chunk; an error mid-stream becomes one error event, then ``[DONE]``.

    When the client disconnects the WSGI server closes this generator, which closes ``chunks`` and
    so aborts the engine work behind it.
    """
    try:
        for chunk in chunks:
            yield frame(chunk)
    except RequestError as exc:
        yield frame(error_body(exc.status, exc.message, exc.type if exc.type != "invalid_request_error" else None, exc.param))
    except Exception as exc:  # noqa: BLE001 - the stream is committed; report in-band
        yield frame(error_body(500, f"Internal error: {type(exc).__name__}"))
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    yield DONE


def start_stream(resp: falcon.Response, chunks: Iterator[dict[str, Any]]) -> None:
    resp.status = falcon.HTTP_200
    resp.content_type = "text/event-stream; charset=utf-8"
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")
    resp.stream = events(chunks)
