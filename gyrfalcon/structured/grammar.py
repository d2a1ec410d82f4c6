"""A request's constraint (``SamplingParams.structured_outputs``) as an llguidance grammar, and its check.

Torch-free: the API side checks a constraint's syntax here (a 400 before any status), the engine
compiles the same grammar text. Both cache by the constraint's text.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from gyrfalcon.errors import RequestError

#: the constraint kinds, in vLLM's names, each with the llguidance grammar format it is written in
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
#: JSON layout: ", " and ": " between items and no other whitespace, which keeps a small model from
#: padding forever (vLLM's ``disable_any_whitespace`` does the same)
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def with_json_format(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with llguidance's JSON layout options (:data:`JSON_FORMAT`; the schema's own win)."""
    return {**schema, "x-guidance": {**JSON_FORMAT, **schema.get("x-guidance", {})}}


def constraint_kind(constraint: dict[str, Any]) -> str:
    """The one kind a constraint sets (see :data:`KINDS`); a :class:`RequestError` otherwise."""
    kinds = [kind for kind in KINDS if constraint.get(kind) not in (None, False)]
    if len(kinds) != 1:
        raise RequestError("structured_outputs must set exactly one of " + ", ".join(KINDS), "structured_outputs")
    return kinds[0]


def _json_schema_grammar(schema: Any) -> str:
    import llguidance

    if isinstance(schema, str):
        schema = json.loads(schema)
    if isinstance(schema, dict):
        schema = with_json_format(schema)
    return llguidance.grammar_from("json_schema", json.dumps(schema))


def grammar_text(constraint: dict[str, Any]) -> str:
    """The llguidance grammar of ``constraint`` (not yet checked: see :func:`check`)."""
    import llguidance

    kind = constraint_kind(constraint)
    value = constraint[kind]
    if kind == "json":
        return _json_schema_grammar(value)
    if kind == "json_object":
        return _json_schema_grammar({"type": "object"})
    if kind == "regex":
        return llguidance.grammar_from("regex", value)
    if kind == "choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise RequestError("choice must list at least one non-empty string", "structured_outputs.choice")
        return llguidance.grammar_from("choice", json.dumps(value))
    if kind == "grammar":
        return llguidance.grammar_from("grammar", value)
    return llguidance.grammar_from("lark", _structural_tag(value))


def _structural_tag(value: Any) -> str:
    """vLLM's structural tag (``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``)
    as a Lark grammar: free text in which each trigger opens a tag whose content follows its schema."""
    import llguidance

    tag = json.loads(value) if isinstance(value, str) else value
    tags = [llguidance.StructTag(trigger=next(t for t in tag["triggers"] if s["begin"].startswith(t)),
                                 begin=s["begin"], grammar=s.get("schema") or {"type": "object"},
                                 end=s["end"])
            for s in tag["structures"]]  # fmt: skip
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


@functools.lru_cache(maxsize=1024)
def _checked(key: str) -> str:
    """The grammar of the constraint serialised as ``key``, checked; its error message otherwise
    (cached both ways: the same bad schema sent again costs a dictionary look-up)."""
    import llguidance

    constraint = json.loads(key)
    try:
        grammar = grammar_text(constraint)
    except (ValueError, KeyError, TypeError, StopIteration) as exc:
        return "\0" + (str(exc) or type(exc).__name__)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        return "\0" + "; ".join(messages)
    return grammar


@functools.lru_cache(maxsize=1024)
def _schema_problem(key: str) -> str | None:
    from jsonschema import exceptions, validators

    schema = json.loads(key)
    try:
        validators.validator_for(schema, default=validators.Draft202012Validator).check_schema(schema)
    except exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        return f"{exc.message}" + (f" (at {where})" if where else "")
    return None


def check_json_schema(schema: Any, param: str) -> None:
    """A 400 naming ``param`` unless ``schema`` is a JSON Schema: valid against the meta-schema of
    the draft its ``$schema`` names (2020-12 by default). Cached by the schema's text, as
    constraints are, so a schema sent with every request is checked once."""
    problem = _schema_problem(constraint_key(schema)) if isinstance(schema, (dict, bool)) else "not an object"
    if problem is not None:
        raise RequestError(f"Invalid JSON Schema in '{param}': {problem[:500]}", param)


def constraint_key(constraint: dict[str, Any]) -> str:
    """The cache key of a constraint: its canonical JSON."""
    return json.dumps(constraint, sort_keys=True, separators=(",", ":"))


def check(constraint: dict[str, Any]) -> str:
    """The checked grammar of ``constraint``; a 400 naming ``structured_outputs.<kind>`` when it is
    not valid (a bad schema, regex or grammar), with the grammar engine's message."""
    kind = constraint_kind(constraint)
    grammar = _checked(constraint_key(constraint))
    if grammar.startswith("\0"):
        raise RequestError(f"Invalid {kind.replace('_', ' ')} constraint: {grammar[1:][:2000]}", f"structured_outputs.{kind}")
    return grammar
