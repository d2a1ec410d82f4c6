"""Typed errors an engine raises at submit; only ``gyrfalcon.api`` turns them into HTTP answers.

An invalid request is a :class:`gyrfalcon.errors.RequestError` with the offending ``param`` (the
same type plugin validators raise). An engine that cannot take a valid request now raises an
:class:`EngineUnavailable` with the seconds after which a retry may succeed.
"""

from __future__ import annotations

import math

from gyrfalcon.engine_api.types import EngineError
from gyrfalcon.errors import Kind, RequestError

#: an invalid request, naming its ``param``
InvalidRequest = RequestError


def retry_after_s(seconds: float) -> int:
    """The whole seconds a client is told to wait before a retry (at least 1): what ``Retry-After``
    says of an :class:`EngineUnavailable` or an in-band error's ``retry_after``."""
    return max(1, math.ceil(seconds))


class EngineUnavailable(Exception):
    """The engine cannot take the request now; a retry after ``retry_after`` seconds may succeed."""

    #: its kind (the error envelope's ``type``)
    type = Kind.OVERLOADED

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class QueueFull(EngineUnavailable):
    """Every place of the engine's waiting queue is taken."""


class ShuttingDown(EngineUnavailable):
    """The engine is stopping (or failed to start) and takes no new requests."""

    type = Kind.SHUTTING_DOWN


#: what a request still queued or running when the server stops ends with (see ``EngineCore.drain``)
SHUTTING_DOWN = EngineError("The server is shutting down; retry the request", type=ShuttingDown.type, retry_after=1.0)
