"""The one error type every layer raises for a request it cannot honour, and the kinds it comes in.

No layer below ``gyrfalcon.api`` speaks HTTP: an error names its *kind* (:class:`Kind`, the
envelope's ``type``) and ``gyrfalcon.api.errors.http_status`` alone turns a kind into a status.
"""

from __future__ import annotations


class Kind:
    """The kinds of error a request can end with (each its envelope's ``type``).

    A refusal of what the request asks is :attr:`INVALID` (the default, what a plugin validator
    raises); a :class:`RequestError` of a kind not listed here is a refusal too (a 400: a plugin may
    name its own kind), an engine's in-band error of such a kind a failure of the server (a 500).
    """

    #: the request cannot be served as asked; ``param`` names the field
    INVALID = "invalid_request_error"
    #: the HTTP layer's own refusals: no or a wrong API key; a body too late, too large or not JSON
    UNAUTHENTICATED = "AuthenticationError"
    BODY_TOO_SLOW = "RequestTimeoutError"
    BODY_TOO_LARGE = "RequestTooLargeError"
    NOT_JSON = "UnsupportedMediaTypeError"
    #: what the request names (a model, a stored response) does not exist
    NOT_FOUND = "NotFoundError"
    #: the client went away before its answer (for the log: nobody reads it)
    CLIENT_CLOSED = "client_closed"
    #: a retry after ``retry_after`` seconds may succeed: the queue is full; the model is loading
    OVERLOADED = "server_overloaded"
    NOT_READY = "ServiceUnavailableError"
    #: the server is stopping; another replica may take a retry
    SHUTTING_DOWN = "server_shutting_down"
    #: the engine failed the request (a bug, NaN logits, a lost replica's stream ended early)
    ENGINE_FAILED = "engine_error"


#: every kind :class:`Kind` names
KINDS = frozenset(value for name, value in vars(Kind).items() if name.isupper())


class RequestError(Exception):
    """A request the server refuses or fails, with the offending field.

    ``param`` names the request field (dotted for nested ones, e.g. ``sampling_params.top_k``);
    ``type`` is its kind (:class:`Kind`; :attr:`Kind.INVALID` for a refusal of what was asked);
    ``retry_after``: seconds after which a retry may succeed (the ``Retry-After`` header).
    """

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        type: str = Kind.INVALID,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.type = type
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"RequestError({self.type}, {self.param!r}, {self.message!r})"
