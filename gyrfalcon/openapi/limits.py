"""The deployment's limits laid over the documents: each :data:`FIELD_LIMITS` entry as JSON Schema.

The table itself (:mod:`gyrfalcon.engine_api.limits`) is what the code enforces; here each entry
becomes the ``maximum``, ``maxItems`` or ``propertyNames`` of the properties it bounds in the served
spec (:func:`gyrfalcon.openapi.served.served_spec`), so a fuzzer's "valid" request is valid here.

Pure Python: importable by the HTTP frontend without torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gyrfalcon.engine_api.limits import FieldLimit, Reach, ServedLimits


def bound_schema(limit: FieldLimit, schema: dict[str, Any], limits: ServedLimits) -> None:
    """Lay ``limit``'s bound over one property's schema (in place)."""
    most = limit.bound(limits)
    if most is None:
        return
    if limit.reach is Reach.VALUE and _is_integer(schema):
        _cap(schema, "maximum", most)
    elif limit.reach is Reach.TOKEN_IDS:
        for sub in walk_schemas(schema):
            if _is_integer(sub):
                _cap(sub, "maximum", most)
    elif limit.reach is Reach.ID_ARRAY_LENGTH:
        for sub in walk_schemas(schema):
            if sub.get("type") == "array" and isinstance(sub.get("items"), dict) and _is_integer(sub["items"]):
                _cap(sub, "maxItems", most)
    elif limit.reach is Reach.PROMPT_COUNT:
        for variant in [schema, *schema.get("oneOf", []), *schema.get("anyOf", [])]:
            items = variant.get("items") if variant.get("type") == "array" else None
            if isinstance(items, dict) and items.get("type") in ("string", "array"):
                _cap(variant, "maxItems", most)
    elif limit.reach is Reach.ID_KEYS and "propertyNames" in schema:
        schema["propertyNames"] = {"pattern": decimal_range_pattern(most)}


def _is_integer(schema: dict[str, Any]) -> bool:
    t = schema.get("type")
    return t == "integer" or (isinstance(t, list) and "integer" in t)


def _cap(schema: dict[str, Any], key: str, most: int) -> None:
    schema[key] = min(schema.get(key, most), most)


def walk_schemas(node: Any) -> Iterator[dict[str, Any]]:
    """Every schema object (dict) inside ``node``, ``node`` itself included, depth first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk_schemas(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk_schemas(value)


def decimal_range_pattern(hi: int) -> str:
    """An anchored regex matching exactly the canonical decimals ``0..hi`` (no leading zeros)."""
    if hi < 0:
        raise ValueError("hi must be >= 0")
    digits = str(hi)
    width = len(digits)
    alts = ["0"]
    if width >= 2:
        alts.append("[1-9]" if width == 2 else f"[1-9][0-9]{{0,{width - 2}}}")
    for i, ch in enumerate(digits):
        low = 1 if i == 0 else 0
        if int(ch) > low:
            rest = width - i - 1
            alts.append(digits[:i] + f"[{low}-{int(ch) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    if hi != 0:
        alts.append(digits)
    return "^(" + "|".join(alts) + ")$"
