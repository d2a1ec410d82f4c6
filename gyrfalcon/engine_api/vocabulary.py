"""The one vocabulary rule: a token id is an integer in ``[0, vocab_size)``.

Only the engine knows the vocabulary's size (``EngineInfo.vocab_size``); the engine's own checks,
the wire's limits (:mod:`gyrfalcon.openapi.limits`) and the plugins that take token ids all ask
here, so the rule and its message are stated once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def is_token_id(value: Any, vocab_size: int) -> bool:
    """Whether ``value`` is a token id of a vocabulary of ``vocab_size`` (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def first_outside_vocabulary(ids: Iterable[Any], vocab_size: int) -> Any | None:
    """The first of ``ids`` that is not a token id of a vocabulary of ``vocab_size``, or None."""
    return next((t for t in ids if not is_token_id(t, vocab_size)), None)


def outside_vocabulary(token_id: Any, param: str, vocab_size: int) -> str:
    """The message of a token id outside the vocabulary."""
    return f"Token id {token_id!r} in '{param}' is outside the vocabulary (size {vocab_size})"
