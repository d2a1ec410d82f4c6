"""Reading a JSON request body: content type and encoding (415), size limit (413), time limit (408).
Parsing (strict JSON, a 400) is :func:`gyrfalcon.protocol.wire.parse_json`, run off the event loop."""

from __future__ import annotations

import asyncio
import falcon.asgi

from gyrfalcon.errors import Kind, RequestError


def check_json_headers(req: falcon.asgi.Request, max_bytes: int) -> None:
    """415 unless the body is uncompressed JSON; 413 when its declared length is over ``max_bytes``."""
    media_type = (req.content_type or "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise RequestError(f"Content-Type must be application/json, got {req.content_type or 'none'!r}", type=Kind.NOT_JSON)
    encoding = (req.get_header("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":
        raise RequestError(f"Content-Encoding {encoding!r} is not supported: send the body uncompressed",
                           type=Kind.NOT_JSON)  # fmt: skip
    length = req.content_length
    if length is not None and length > max_bytes:
        raise RequestError(f"The request body is {length} bytes; the limit is {max_bytes}", type=Kind.BODY_TOO_LARGE)


async def read_raw(req: falcon.asgi.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The body's bytes (chunked or not): 413 beyond ``max_bytes``, 408 when the client takes more
    than ``timeout_s`` to send it."""
    try:
        raw = await asyncio.wait_for(req.stream.read(max_bytes + 1), timeout_s)
    except TimeoutError:
        raise RequestError(f"The request body did not arrive within {timeout_s:g} s", type=Kind.BODY_TOO_SLOW) from None
    if len(raw) > max_bytes:
        raise RequestError(f"The request body exceeds the limit of {max_bytes} bytes", type=Kind.BODY_TOO_LARGE)
    return raw
