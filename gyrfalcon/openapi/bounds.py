"""The documents' own bounds of a request field, for the code that checks values off the wire.

The engine's policies (plugins' ``validate``) check the ``SamplingParams`` any caller hands the
engine; they read each field's range and sizes here rather than restating them, so the OpenAPI
documents stay the one home of every bound. A field is bounded alike wherever the documents
state it (an import-time error otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

from gyrfalcon.openapi.served import bundle, request_schema_names

_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems", "uniqueItems")


@cache
def field_keywords(name: str) -> dict[str, Any]:
    """The validation keywords the documents give request field ``name`` (its items' not included)."""
    spec = bundle()
    schemas = spec["components"]["schemas"]
    found: dict[str, Any] | None = None
    for schema_name in request_schema_names(spec):
        prop = schemas[schema_name].get("properties", {}).get(name)
        if prop is None:
            continue
        keywords = {k: prop[k] for k in _KEYWORDS if k in prop}
        if found is not None and keywords != found:
            raise ValueError(f"the documents bound {name!r} differently in {schema_name}: {keywords} against {found}")
        found = keywords
    if found is None:
        raise KeyError(f"no request field {name!r} in the documents")
    return dict(found)


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
    k = field_keywords(name)
    low, high = k.get("exclusiveMinimum", k.get("minimum")), k.get("exclusiveMaximum", k.get("maximum"))
    return Range(name, low, high, "exclusiveMinimum" in k, "exclusiveMaximum" in k)
