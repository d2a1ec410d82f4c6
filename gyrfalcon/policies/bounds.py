"""The documents' own bounds of a request field, for the code that checks values off the wire.

A request that came through the API had its fields' bounds decided on the wire (the generated
models); an engine request built without it (benchmarks, tests) has them decided by
:meth:`gyrfalcon.validation.RequestValidator.check_bounds`, which reads each field's range and sizes
here (:func:`keyword_refusal`) rather than restating them, so the OpenAPI documents stay the one
home of every bound; the policies read sizes they need here too (the most ``logprob_token_ids``). ``python -m gyrfalcon.codegen`` writes the documents'
keywords into ``generated/field_bounds.py`` (``openapi/served.py:request_field_keywords``), so the
engine process reads Python data, never YAML. A field must be bounded alike wherever the
documents state it (an error at its first use otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

from gyrfalcon.generated.field_bounds import FIELD_KEYWORDS


def field_keywords(name: str) -> dict[str, Any]:
    """The validation keywords the documents give request field ``name`` (its items' not included),
    from the table codegen wrote (:mod:`gyrfalcon.generated.field_bounds`): the engine process
    never reads the documents."""
    if name not in FIELD_KEYWORDS:
        raise KeyError(f"no request field {name!r} in the documents")
    keywords = FIELD_KEYWORDS[name]
    if keywords is None:
        raise ValueError(f"the documents bound {name!r} differently in two request schemas")
    return dict(keywords)


@dataclass(frozen=True)
class Range:
    """A numeric field's range as the documents state it (None: unbounded on that side)."""

    name: str
    low: float | None
    high: float | None
    low_open: bool = False
    high_open: bool = False

    def refusal(self, value: Any) -> str | None:
        """Why ``value`` is outside the range (a message naming the field), or None."""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
            high_ok = self.high is None or (value < self.high if self.high_open else value <= self.high)
            if low_ok and high_ok:
                return None
        if self.low is not None and self.high is not None:
            return (f"{self.name} must be in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                    f"{')' if self.high_open else ']'}")  # fmt: skip
        if self.low is not None:
            return f"{self.name} must be a finite number {'>' if self.low_open else '>='} {self.low:g}"
        return f"{self.name} must be a finite number {'<' if self.high_open else '<='} {self.high:g}"


@cache
def field_range(name: str) -> Range:
    """The range of numeric request field ``name``."""
    return _range(name, field_keywords(name))


def _range(name: str, k: dict[str, Any]) -> Range:
    low, high = k.get("exclusiveMinimum", k.get("minimum")), k.get("exclusiveMaximum", k.get("maximum"))
    return Range(name, low, high, "exclusiveMinimum" in k, "exclusiveMaximum" in k)


def keyword_refusal(value: Any, keywords: dict[str, Any], param: str) -> str | None:
    """Why ``value`` breaks ``keywords`` (a field's ``minimum``/``maximum`` and exclusive forms,
    ``minItems``, ``maxItems``, ``uniqueItems``, as :func:`field_keywords` gives them), a message
    naming ``param``; None when it keeps them."""
    if any(k in keywords for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        refusal = _range(param, keywords).refusal(value)
        if refusal is not None:
            return refusal
    if isinstance(value, (list, tuple, dict)):
        if len(value) < keywords.get("minItems", 0):
            return f"'{param}' must hold at least {keywords['minItems']} item(s)"
        if "maxItems" in keywords and len(value) > keywords["maxItems"]:
            return f"'{param}' holds at most {keywords['maxItems']} items"
        if keywords.get("uniqueItems") and len(set(map(repr, value))) != len(value):
            return f"'{param}' must not repeat an item"
    return None
