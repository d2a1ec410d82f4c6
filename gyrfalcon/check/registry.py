"""What a check is, what it can conclude, and the one list of them.

A check is a function of a :class:`~gyrfalcon.check.target.Target` tagged with the endpoint it
exercises and the features it needs. It concludes one of five outcomes:

- **passed**: the server kept the promise;
- **failed**: the server accepted the request and did something else (or answered 5xx) — the report
  carries the request that shows it, as a ``curl`` line;
- **unsupported**: the server refused a feature the check needs loudly (a 4xx naming it, a 404 for a
  route it lacks) — honest, and not a failure;
- **inconclusive**: what the model itself answered leaves nothing to check (no stop string can be
  chosen from any answer, a distribution that allows one answer only): not a failure — the
  checker never accuses a server of what its model did;
- **error**: the check could not run (the server could not be reached).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

#: Endpoint groups, the values ``--only`` takes (``schema`` is the Schemathesis phase).
ENDPOINTS = ("models", "completions", "chat", "batch", "generate", "responses", "errors", "schema")


class Outcome(enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"
    INCONCLUSIVE = "inconclusive"
    ERROR = "error"


class Unsupported(Exception):
    """The server refused, loudly, a feature the check needs."""


class Inconclusive(Exception):
    """The model's own answers do not give the check what it needs (after its retries)."""


class Broken(AssertionError):
    """The server accepted the request and did something else."""


@dataclass(frozen=True)
class Check:
    name: str
    endpoint: str
    features: tuple[str, ...]
    doc: str
    run: Callable[[Any], None]


@dataclass
class Result:
    check: Check
    outcome: Outcome
    message: str = ""
    #: the request that shows a failure, as a shell line
    reproduce: str = ""
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


CHECKS: list[Check] = []


def check(endpoint: str, *features: str, name: str | None = None, params: Iterable[tuple[str, Any]] | None = None):
    """Register the decorated function as a check (or, with ``params``, one check per
    ``(suffix, value)``, called as ``fn(target, value)``).

    The function's docstring is the promise it checks; ``features`` are what a server must offer
    for the check to apply (a loud refusal of one of them is "unsupported")."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"unknown endpoint group {endpoint!r}")

    def register(fn: Callable[..., None]) -> Callable[..., None]:
        base = name or fn.__name__
        doc = " ".join((fn.__doc__ or "").split())
        if params is None:
            _add(Check(f"{endpoint}.{base}", endpoint, features, doc, fn))
        else:
            for suffix, value in params:
                _add(Check(f"{endpoint}.{base}[{suffix}]", endpoint, features, doc,
                           lambda target, _fn=fn, _value=value: _fn(target, _value)))  # fmt: skip
        return fn

    return register


def _add(one: Check) -> None:
    if any(c.name == one.name for c in CHECKS):
        raise ValueError(f"two checks named {one.name}")
    CHECKS.append(one)
