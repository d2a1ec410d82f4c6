"""Server-sent events: ``resp.stream`` is an async iterator of ``data: ...`` frames with a ``close()``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import falcon
import orjson

from gyrfalcon.api.errors import error_body, log, request_error_body
from gyrfalcon.errors import RequestError

DONE = b"data: [DONE]\n\n"


def frame(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


class EventStream:
    """The body of a streamed response: SSE frames of ``chunks``, then ``data: [DONE]``.

    An error mid-stream becomes one error event, then ``[DONE]``. Falcon awaits :meth:`close`
    however the response ends, which closes ``chunks`` and so aborts the engine work behind it,
    whether or not iteration had started.
    """

    def __init__(self, chunks: AsyncIterator[dict[str, Any]]) -> None:
        self._chunks = chunks
        self._frames = self._generate()

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> bytes:
        return await self._frames.__anext__()

    async def close(self) -> None:
        await self._frames.aclose()
        await self._close_chunks()

    async def _close_chunks(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            await close()

    async def _generate(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._chunks:
                yield frame(chunk)
        except RequestError as exc:
            yield frame(request_error_body(exc))
        except Exception as exc:  # noqa: BLE001 - the stream is committed; report in-band
            log.exception("error in a stream")
            yield frame(error_body(500, f"Internal error: {type(exc).__name__}"))
        finally:
            await self._close_chunks()
        yield DONE


def start_stream(resp: falcon.Response, chunks: AsyncIterator[dict[str, Any]]) -> None:
    resp.status = falcon.HTTP_200
    resp.content_type = "text/event-stream; charset=utf-8"
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")
    resp.stream = EventStream(chunks)
