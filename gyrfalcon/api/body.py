"""Reading a JSON request body: content type and encoding (415), size limit (413), time limit (408).
Parsing (strict JSON, a 400) is :func:`gyrfalcon.protocol.wire.parse_json`, run off the event loop."""

from __future__ import annotations

import asyncio
import falcon.asgi

from gyrfalcon.api.errors import APIError


def check_json_headers(req: falcon.asgi.Request, max_bytes: int) -> None:
    """415 unless the body is uncompressed JSON; 413 when its declared length is over ``max_bytes``."""
    media_type = (req.content_type or "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {req.content_type or 'none'!r}")
    encoding = (req.get_header("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":
        raise APIError(415, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed")
    length = req.content_length
    if length is not None and length > max_bytes:
        raise APIError(413, f"The request body is {length} bytes; the limit is {max_bytes}")


async def read_raw(req: falcon.asgi.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The body's bytes (chunked or not): 413 beyond ``max_bytes``, 408 when the client takes more
    than ``timeout_s`` to send it."""
    try:
        raw = await asyncio.wait_for(req.stream.read(max_bytes + 1), timeout_s)
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout_s:g} s",
                       headers={"Connection": "close"}) from None  # fmt: skip
    if len(raw) > max_bytes:
        raise APIError(413, f"The request body exceeds the limit of {max_bytes} bytes")
    return raw
