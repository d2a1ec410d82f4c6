"""One error envelope for every non-2xx answer, Falcon's own 404/405/413 included.

``{"error": {"message": str, "type": str, "param": str | null, "code": int}}`` with the HTTP status as
``code``.
"""

from __future__ import annotations

import logging
from typing import Any

import falcon
import falcon.asgi
import orjson

from gyrfalcon.engine_api.errors import EngineUnavailable, ShuttingDown, retry_after_s
from gyrfalcon.engine_api.types import EngineError
from gyrfalcon.errors import RequestError

log = logging.getLogger("gyrfalcon.api")

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    414: "URITooLongError",
    415: "UnsupportedMediaTypeError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


#: the HTTP status of an error that names none, by its kind (``type``); any other kind is a 500
_STATUS_OF_KIND = {"invalid_request_error": 400, EngineUnavailable.type: 503, ShuttingDown.type: 503}


def http_status(error: RequestError | EngineError) -> int:
    """The HTTP status of a refusal or an engine's in-band error: the one it asks for, else its
    kind's (an :class:`EngineError` names none: the engine speaks no HTTP)."""
    status = getattr(error, "status", None)
    return status if status is not None else _STATUS_OF_KIND.get(error.type, 500)


def error_body(status: int, message: str, type: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or _TYPES.get(status, "error"), "param": param, "code": status}}


class APIError(falcon.HTTPError):
    """A Falcon HTTP error that carries the envelope's ``type`` and ``param``."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(falcon.code_to_http_status(status), description=message, headers=headers)
        self.error_type = type
        self.param = param

    @classmethod
    def from_request_error(cls, error: RequestError) -> APIError:
        return cls(http_status(error), error.message, envelope_type(error), error.param, _retry_after(error.retry_after))


def _retry_after(seconds: float | None) -> dict[str, str] | None:
    """The ``Retry-After`` header of a refusal that may succeed later (whole seconds, at least 1)."""
    return None if seconds is None else {"Retry-After": str(retry_after_s(seconds))}


def envelope_type(error: RequestError) -> str | None:
    """The envelope's ``type`` of a refusal: its own, or (None) the status's name for a plain 400."""
    return error.type if error.type != "invalid_request_error" else None


def request_error_body(error: RequestError) -> dict[str, Any]:
    """The envelope of a refusal, at submit time (the response's body) or inside a stream (an event)."""
    return error_body(http_status(error), error.message, envelope_type(error), error.param)


def serialize_error(req: falcon.Request, resp: falcon.Response, exception: falcon.HTTPError) -> None:
    """Falcon's error serializer: every HTTPError becomes the envelope."""
    status = exception.status_code
    message = exception.description or exception.title or falcon.code_to_http_status(status)
    type_ = getattr(exception, "error_type", None)
    param = getattr(exception, "param", None)
    if isinstance(exception, falcon.HTTPRouteNotFound) or status == 404 and not message:
        message = f"No route for {req.method} {req.path}"
    resp.content_type = falcon.MEDIA_JSON
    resp.data = orjson.dumps(error_body(status, message, type_, param))


async def handle_request_error(req: falcon.Request, resp: falcon.Response, ex: RequestError, params: dict) -> None:
    raise APIError.from_request_error(ex)


async def handle_engine_unavailable(req: falcon.Request, resp: falcon.Response, ex: EngineUnavailable, params: dict) -> None:
    raise APIError(503, ex.message, ex.type, None, _retry_after(ex.retry_after))


async def handle_unexpected(req: falcon.Request, resp: falcon.Response, ex: Exception, params: dict) -> None:
    if isinstance(ex, falcon.HTTPError):
        raise ex
    log.exception("unhandled error on %s %s", req.method, req.path)
    raise APIError(500, f"Internal error: {type(ex).__name__}")


def install(app: falcon.asgi.App) -> None:
    app.set_error_serializer(serialize_error)
    app.add_error_handler(Exception, handle_unexpected)
    app.add_error_handler(RequestError, handle_request_error)
    app.add_error_handler(EngineUnavailable, handle_engine_unavailable)
