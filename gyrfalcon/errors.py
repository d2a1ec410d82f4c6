"""The one error type every layer raises for a request it cannot honour."""

from __future__ import annotations


class RequestError(Exception):
    """A request the server refuses, with the offending field.

    ``param`` names the request field (dotted for nested ones, e.g. ``sampling_params.top_k``);
    ``type`` is the OpenAI-style error type; ``retry_after``: seconds after which a retry may
    succeed (a 503). ``status`` is the HTTP status a refusal asks for (a plugin may choose one; 400
    by default); None leaves it to the error's ``type`` (an engine's in-band error, which speaks no
    HTTP). The API layer (``api/errors.py``, the one place that speaks HTTP) turns this into the
    error envelope ``{"error": {"message", "type", "param", "code"}}`` with ``code`` = the status,
    and ``retry_after`` into a ``Retry-After`` header.
    """

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int | None = 400,
        type: str = "invalid_request_error",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"RequestError({self.status}, {self.param!r}, {self.message!r})"
