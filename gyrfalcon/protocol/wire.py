"""From request bytes to a strictly validated generated model, with errors that name their field."""

from __future__ import annotations

import functools
import re
from typing import Any, TypeVar

import orjson
import pydantic

from gyrfalcon.errors import RequestError

M = TypeVar("M", bound=pydantic.BaseModel)

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Parts of a pydantic error location that name a union member or a validator, not a field.
_NOT_A_FIELD = re.compile(r"^(str|int|float|bool|list|dict|tuple|none|is-instance|function-.*|literal.*)$", re.I)


#: deepest nesting of arrays and objects in a request body; no field needs more than a handful
MAX_DEPTH = 64


def parse_json(raw: bytes, max_items: int | None = None, max_keys: int | None = None) -> Any:
    """Parse a body with orjson; whole floats become ints (JSON has one number type).

    Raises a 400 for malformed JSON, for nesting deeper than :data:`MAX_DEPTH`, for an array longer
    than ``max_items`` and for an object with more than ``max_keys`` keys (no request field takes
    one: refused before the body is walked, so a huge id list or map costs no Python work).
    """
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"Malformed JSON body: {exc}", None) from None
    if type(data) is float:
        return _whole(data)
    if type(data) is list or type(data) is dict:
        _normalise(data, max_items, max_keys)
    return data


def _whole(value: float) -> int | float:
    return int(value) if value.is_integer() and abs(value) < 2**63 else value


def _normalise(root: list | dict, max_items: int | None, max_keys: int | None) -> None:
    """In place, in document order: whole floats become ints, and the bounds are checked. A
    container's path is a chain of ``(parent, key)`` links, spelled out only for an error: a 1 MB
    schema's 100,000 values cost one visit each (building each one's dotted path took 40 ms).
    orjson makes plain ``dict``, ``list`` and ``float`` objects: exact type checks (half the time of
    ``isinstance``; a 1 MB schema 7 ms)."""
    stack: list[tuple[Any, Any, int]] = [(root, None, 0)]
    while stack:
        node, link, depth = stack.pop()
        if depth >= MAX_DEPTH:
            raise RequestError(f"The body nests arrays and objects more than {MAX_DEPTH} levels deep", _spelled(link))
        is_list = type(node) is list
        bound = max_items if is_list else max_keys
        if bound is not None and len(node) > bound:
            path = _spelled(link)
            where = f"'{path}'" if path else "The body"
            what = (f"{len(node):,} items; no request field takes more than {bound:,} here" if is_list
                    else f"{len(node):,} keys; no request object takes more than {bound:,} here")  # fmt: skip
            raise RequestError(f"{where} holds {what}", path)
        children = []
        for key, value in enumerate(node) if is_list else node.items():
            kind = type(value)
            if kind is dict or kind is list:
                children.append((value, (link, key), depth + 1))
            elif kind is float:
                node[key] = _whole(value)  # a value replaced, never a key added: the walk is safe
        if children:
            children.reverse()
            stack.extend(children)


def _spelled(link: Any) -> str | None:
    """The dotted path of a ``(parent, key)`` chain (None: the body itself)."""
    keys = []
    while link is not None:
        link, key = link
        keys.append(str(key))
    return ".".join(reversed(keys)) or None


def check_text_length(value: Any, param: str, bound: int, context: int) -> None:
    """A 400 when the text in ``value`` (a string, or the strings anywhere in messages) is over
    ``bound`` characters: more than a context of ``context`` tokens can hold. It names the one string
    over the bound by itself where there is one (``messages.1.tool_calls.0.function.arguments``),
    else ``param``. Found before tokenizing or rendering, whose cost grows with the text."""
    chars, stack = 0, [(value, param)]
    while stack and chars <= bound:
        item, path = stack.pop()
        if isinstance(item, str):
            chars += len(item)
            if len(item) > bound:
                param = path
        elif isinstance(item, dict):
            stack.extend((v, f"{path}.{k}") for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{path}.{i}") for i, v in enumerate(item))
    if chars > bound:
        raise RequestError(f"The text of '{param}' is over {bound:,} characters: more than the model's context of "
                           f"{context:,} tokens can hold", param)


@functools.cache
def _model_names() -> frozenset[str]:
    """Names of the generated models: a union of models tags its members' errors with them."""
    from gyrfalcon.generated import common, generate, openai

    return frozenset(name for module in (common, generate, openai) for name, value in vars(module).items()
                     if isinstance(value, type) and issubclass(value, pydantic.BaseModel))  # fmt: skip


def error_param(loc: tuple[Any, ...]) -> str | None:
    """A dotted field path from a pydantic error location, without union-member tags."""
    parts = [str(p) for p in loc if isinstance(p, int) or (_IDENTIFIER.match(str(p)) and not _NOT_A_FIELD.match(str(p))
                                                           and str(p) not in _model_names())]  # fmt: skip
    return ".".join(parts) or None


def sent_fields(wire: pydantic.BaseModel) -> dict[str, Any]:
    """The fields a client set, by wire name, with ``null`` meaning "not set" (OpenAI's and vLLM's
    rule): null values are dropped here, in nested objects too, so every later step sees an absent
    field and applies its default."""
    return without_nulls(wire.model_dump(mode="python", by_alias=True, exclude_unset=True))


def without_nulls(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` without its null entries, in nested objects too (null is "not set")."""
    return {k: without_nulls(v) if isinstance(v, dict) else v for k, v in value.items() if v is not None}


def validate(model: type[M], data: Any, prefix: str | None = None) -> M:
    """Validate ``data`` strictly against a generated model; the first error becomes a 400."""
    if not isinstance(data, dict):
        raise RequestError("The request body must be a JSON object", prefix)
    try:
        return model.model_validate(data, strict=True)
    except pydantic.ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)  # a third of the time
        # A failed union reports one error per member. A member whose only complaint is a bound
        # (``[-1]`` as token ids: "greater than or equal to 0") is the one the client meant; type
        # mismatches of the other members say nothing. Otherwise the shortest location names the
        # field best.
        first = min(errors, key=lambda e: (e["type"].endswith("_type"), len(e["loc"])))
        param = error_param(first["loc"])
        if prefix:
            param = f"{prefix}.{param}" if param else prefix
        if first["type"] == "extra_forbidden":
            message = f"Unknown or unsupported field '{param}'"
        elif first["type"] == "missing":
            message = f"Field '{param}' is required"
        else:
            message = f"Invalid value for '{param}': {first['msg']}"
        siblings = [f"{prefix}.{s}" if prefix else s for s in _siblings(errors, first)]
        raise RequestError(message + _also(siblings, len(siblings)), param) from None


def _also(params: list[str], count: int) -> str:
    """The rest of ``count`` bad entries of one field (logit_bias keys) after the one a refusal
    names: the first few of ``params`` named, the others counted."""
    if not count:
        return ""
    more = count - NAMED_SIBLINGS
    return "; also " + ", ".join(f"'{p}'" for p in params[:NAMED_SIBLINGS]) + (f" and {more:,} more" if more > 0 else "")


def check_key_patterns(fields: Any, patterns: dict[str, str], prefix: str | None = None) -> None:
    """A 400 for the keys of a map field of ``fields`` that do not match the field's ``propertyNames``
    pattern (``patterns``: field name to pattern, from the documents), naming the first few bad keys
    and counting the rest, as :func:`validate` would. Checked in Python before the generated model
    sees the body: pydantic reported a vocabulary-sized map of bad keys as one error object per key,
    ~100 ms of CPU a body, most of it holding the interpreter's lock (the worker's other requests
    waited), where this loop costs a few ms and lets other threads run."""
    if not isinstance(fields, dict):
        return
    for name, pattern in patterns.items():
        value = fields.get(name)
        if not isinstance(value, dict) or not value:
            continue
        matches = _compiled(pattern).search
        bad = [key for key in value if not matches(key)]
        if bad:
            field = f"{prefix}.{name}" if prefix else name
            params = [f"{field}.{key}" for key in bad[: NAMED_SIBLINGS + 1]]
            message = f"Invalid value for '{params[0]}': String should match pattern '{pattern}'"
            raise RequestError(message + _also(params[1:], len(bad) - 1), params[0])


@functools.cache
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


#: how many other bad entries of the same field a refusal names (it counts the rest): a body of
#: 20,000 bad logit_bias keys made a 400 KB message, and finding them one list lookup each took
#: seconds of CPU (quadratic)
NAMED_SIBLINGS = 8


def _siblings(errors: list[Any], first: Any) -> list[str]:
    """Params of the other errors of the same kind on entries of the same field as ``first``, in order."""
    own = error_param(first["loc"]) or ""
    parent = own.rpartition(".")[0]
    if not parent:
        return []
    found: dict[str, None] = {}
    for error in errors:
        if error["type"] == first["type"]:
            param = error_param(error["loc"]) or ""
            if param != own and param.rpartition(".")[0] == parent:
                found[param] = None
    return list(found)
