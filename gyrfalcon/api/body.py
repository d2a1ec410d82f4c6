"""Reading a JSON request body: content type and encoding (415), size limit (413), then strict JSON (400)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import falcon

from gyrfalcon.api.errors import APIError
from gyrfalcon.protocol.wire import parse_json


def read_json(req: falcon.Request, max_bytes: int, max_items: Callable[[], int | None] = lambda: None) -> Any:
    """The body as JSON: 415 unless JSON, 413 beyond ``max_bytes``, 400 when malformed or holding
    an array longer than ``max_items()`` (asked only once the body is read)."""
    media_type = (req.content_type or "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {req.content_type or 'none'!r}")
    encoding = (req.get_header("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":
        raise APIError(415, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed")
    length = req.content_length
    if length is not None and length > max_bytes:
        raise APIError(413, f"The request body is {length} bytes; the limit is {max_bytes}")
    # a chunked body has no length: gunicorn's input then yields the decoded chunks until the end
    # (falcon's bounded stream would read none of it)
    stream = req.bounded_stream if length is not None else req.stream
    raw = stream.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise APIError(413, f"The request body exceeds the limit of {max_bytes} bytes")
    return parse_json(raw, max_items())
