"""One error envelope for every non-2xx answer, Falcon's own 404/405/413 included, and the one place
where an error's kind becomes an HTTP status.

``{"error": {"message": str, "type": str, "param": str | null, "code": int}}`` with the HTTP status as
``code``. Every layer, this one's own checks included, raises a :class:`RequestError` of a
:class:`Kind`; an engine's in-band :class:`EngineError` carries a kind too.
"""

from __future__ import annotations

import logging
from typing import Any

import falcon
import falcon.asgi
import orjson

from gyrfalcon.engine_api.errors import EngineUnavailable, ShuttingDown, retry_after_s
from gyrfalcon.engine_api.types import EngineError
from gyrfalcon.errors import Kind, RequestError

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


#: the HTTP status of each kind of error (its ``type``); see :func:`http_status` for any other kind
_STATUS_OF_KIND = {
    Kind.INVALID: 400,
    Kind.UNAUTHENTICATED: 401,
    Kind.NOT_FOUND: 404,
    Kind.BODY_TOO_SLOW: 408,
    Kind.BODY_TOO_LARGE: 413,
    Kind.NOT_JSON: 415,
    Kind.CLIENT_CLOSED: 499,  # nginx's convention, for the log: nobody reads the answer
    Kind.OVERLOADED: 503,
    Kind.NOT_READY: 503,
    Kind.SHUTTING_DOWN: 503,
    Kind.ENGINE_FAILED: 500,
}
#: headers a kind's answer carries besides ``Retry-After``
_HEADERS_OF_KIND = {
    Kind.UNAUTHENTICATED: {"WWW-Authenticate": "Bearer"},
    Kind.BODY_TOO_SLOW: {"Connection": "close"},  # the rest of a late body is not read
}


def http_status(error: RequestError | EngineError | EngineUnavailable) -> int:
    """The HTTP status of a refusal, an engine's in-band error or its refusal to take a request now.
    A kind of its own is a refusal (400) when a :class:`RequestError` names it (a plugin's), and a
    failure (500) when an engine's in-band error does."""
    return _STATUS_OF_KIND.get(error.type, 400 if isinstance(error, RequestError) else 500)


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
    def from_request_error(cls, error: RequestError | EngineUnavailable) -> APIError:
        headers = dict(_HEADERS_OF_KIND.get(error.type, {}))
        if error.retry_after is not None:  # whole seconds, at least 1
            headers["Retry-After"] = str(retry_after_s(error.retry_after))
        return cls(http_status(error), error.message, envelope_type(error), getattr(error, "param", None), headers or None)


def envelope_type(error: RequestError | EngineUnavailable) -> str | None:
    """The envelope's ``type`` of a refusal: its own, or (None) the status's name for a plain 400."""
    return error.type if error.type != Kind.INVALID else None


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
    raise APIError.from_request_error(_without_frames(ex))


def _without_frames(error: BaseException) -> BaseException:
    """``error`` and the exceptions it chains, their tracebacks dropped.

    Why: a refusal's traceback (and that of the pydantic error it was raised from) holds every
    frame it left, and their locals the parsed body and its validation errors (a 20,000-key
    logit_bias: 20,000 dicts), in a reference cycle with the handlers' frames; dropped here, they go
    with the request instead of waiting for the collector's full pass."""
    link: BaseException | None = error
    while link is not None:
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return error


async def handle_engine_unavailable(req: falcon.Request, resp: falcon.Response, ex: EngineUnavailable, params: dict) -> None:
    raise APIError.from_request_error(ex)


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
