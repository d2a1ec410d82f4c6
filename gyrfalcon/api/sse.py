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


def named_frame(data: dict[str, Any]) -> bytes:
    """An event named by its ``type`` (the Responses API's framing)."""
    return b"event: " + data["type"].encode() + b"\n" + frame(data)


class EventStream:
    """The body of a streamed response: SSE frames of ``chunks``, then ``data: [DONE]``.

    An error mid-stream becomes one error event, then ``[DONE]``. With ``named`` (the Responses
    API) each frame is named by its chunk's ``type``, an error is an ``error`` event carrying the
    next ``sequence_number``, and no ``[DONE]`` follows. Falcon awaits :meth:`close` however the
    response ends, which closes ``chunks`` and so aborts the engine work behind it, whether or not
    iteration had started.
    """

    def __init__(self, chunks: AsyncIterator[dict[str, Any]], named: bool = False) -> None:
        self._chunks = chunks
        self._named = named
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
        sequence = 0
        try:
            async for chunk in self._chunks:
                sequence = chunk.get("sequence_number", sequence) + 1
                yield named_frame(chunk) if self._named else frame(chunk)
        except RequestError as exc:
            yield self._error(request_error_body(exc), sequence)
        except Exception as exc:  # noqa: BLE001 - the stream is committed; report in-band
            log.exception("error in a stream")
            yield self._error(error_body(500, f"Internal error: {type(exc).__name__}"), sequence)
        finally:
            await self._close_chunks()
        if not self._named:
            yield DONE

    def _error(self, body: dict[str, Any], sequence: int) -> bytes:
        if not self._named:
            return frame(body)
        error = body["error"]
        return named_frame({"type": "error", "code": error["type"], "message": error["message"], "param": error["param"],
                            "sequence_number": sequence})  # fmt: skip


def start_stream(resp: falcon.Response, chunks: AsyncIterator[dict[str, Any]], named: bool = False) -> None:
    resp.status = falcon.HTTP_200
    resp.content_type = "text/event-stream; charset=utf-8"
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")
    resp.stream = EventStream(chunks, named)
