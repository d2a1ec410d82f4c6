"""A request's constraint (``SamplingParams.structured_outputs``) as an llguidance grammar, and its check.

Torch-free: the API side checks a constraint's syntax here (a 400 before any status), the engine
compiles the same grammar text. A constraint or tool schema is bounded before any work
(:data:`MAX_CONSTRAINT_BYTES` of canonical JSON, :data:`MAX_CONSTRAINT_NODES` objects and arrays);
checks are cached by a hash of that text, within a byte budget (:class:`DigestCache`): 30 distinct
1 MB tool schemas once grew an API worker by 344 MiB for good, the whole schemas kept as keys.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from typing import Any, Callable

from gyrfalcon.errors import RequestError

#: the constraint kinds, in vLLM's names, each with the llguidance grammar format it is written in
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
#: JSON layout: ", " and ": " between items and no other whitespace, which keeps a small model from
#: padding forever (vLLM's ``disable_any_whitespace`` does the same)
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


#: the largest constraint or tool schema, as canonical JSON: about 2,500 short properties. The check
#: against JSON Schema 2020-12's meta-schema (jsonschema, through its dynamic references) costs about
#: 0.25 ms a property on this project's machines, so this bound keeps one schema's check under a
#: second of CPU (OpenAI's structured outputs take up to 5,000 properties: those need two requests'
#: worth of a worker here, and are refused)
MAX_CONSTRAINT_BYTES = 64 * 1024
#: the most objects and arrays a constraint or tool schema may nest (each is a node of its grammar)
MAX_CONSTRAINT_NODES = 20_000
#: a cache's byte budget (keys are digests: the budget is the values'), and its largest entry
CACHE_BYTES = 8 * 1024 * 1024
CACHE_ENTRY_BYTES = 256 * 1024


def digest(text: str) -> bytes:
    """The SHA-256 of a constraint's canonical text: what caches key it by."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class DigestCache:
    """A least-recently-used map from a text's SHA-256 to what was computed from it, holding at most
    ``budget`` bytes of values (``size(value)``); a value larger than ``entry_bytes`` is not kept.
    Thread-safe; the computation runs outside the lock."""

    def __init__(self, size: Callable[[Any], int], budget: int = CACHE_BYTES, entry_bytes: int = CACHE_ENTRY_BYTES) -> None:
        self._size, self.budget, self.entry_bytes = size, budget, entry_bytes
        self._entries: collections.OrderedDict[bytes, tuple[Any, int]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, text: str, compute: Callable[[str], Any]) -> Any:
        """The value of ``text``: cached, else ``compute(text)`` (kept when it fits)."""
        key = digest(text)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[0]
        value = compute(text)
        size = self._size(value) + len(key) + 64  # the entry's own overhead, roughly
        if size <= self.entry_bytes:
            with self._lock:
                if key not in self._entries:
                    self._entries[key] = (value, size)
                    self._bytes += size
                    while self._bytes > self.budget:
                        self._bytes -= self._entries.popitem(last=False)[1][1]
        return value

    @property
    def bytes(self) -> int:
        """The bytes its entries are counted as."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)


def _least_json_bytes(value: Any) -> int:
    """The least bytes ``value`` takes as JSON (its strings and keys, quoted), counted up to just
    past :data:`MAX_CONSTRAINT_BYTES`, or more than that when it holds more than
    :data:`MAX_CONSTRAINT_NODES` objects and arrays -1: in Python that yields the GIL, where
    json.dumps of a 1 MB schema held it 30 ms before the size could be refused."""
    nodes, least, stack = 0, 0, [value]
    while stack and least <= MAX_CONSTRAINT_BYTES:
        item = stack.pop()
        if isinstance(item, str):
            least += len(item) + 2
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
            nodes += 1
        elif isinstance(item, list):
            stack.extend(item)
            nodes += 1
        if nodes > MAX_CONSTRAINT_NODES:
            return -1
    return least


def bounded_key(value: Any, param: str) -> str:
    """The canonical JSON of a constraint or schema (its cache key); a 400 naming ``param`` when it
    holds more than :data:`MAX_CONSTRAINT_NODES` objects and arrays (counted only up to the bound)
    or is larger than :data:`MAX_CONSTRAINT_BYTES`."""
    least = _least_json_bytes(value)
    if least < 0:
        raise RequestError(f"'{param}' holds more than {MAX_CONSTRAINT_NODES:,} objects and arrays", param)
    if least > MAX_CONSTRAINT_BYTES:
        raise RequestError(f"'{param}' is more than {MAX_CONSTRAINT_BYTES:,} bytes as JSON; at most "
                           f"{MAX_CONSTRAINT_BYTES:,} are taken", param)  # fmt: skip
    try:
        key = json.dumps(value, sort_keys=True, separators=(",", ":"))
    except RecursionError:  # only from Python callers: a body nests at most MAX_DEPTH levels
        raise RequestError(f"'{param}' nests too deeply", param) from None
    if len(key) > MAX_CONSTRAINT_BYTES:
        raise RequestError(f"'{param}' is {len(key):,} bytes as JSON; at most {MAX_CONSTRAINT_BYTES:,} are taken", param)
    return key


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


def _checked(key: str) -> str:
    """The grammar of the constraint serialised as ``key``, checked; its error message otherwise
    (cached both ways: the same bad schema sent again costs a look-up)."""
    import llguidance

    constraint = json.loads(key)
    try:
        grammar = grammar_text(constraint)
    except (ValueError, KeyError, TypeError, AttributeError, StopIteration) as exc:
        return "\0" + (str(exc) or type(exc).__name__)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        return "\0" + "; ".join(messages)
    return grammar


def _schema_problem(key: str) -> str | None:
    from jsonschema import exceptions, validators

    schema = json.loads(key)
    try:
        validators.validator_for(schema, default=validators.Draft202012Validator).check_schema(schema)
    except exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        return f"{exc.message}" + (f" (at {where})" if where else "")
    return None


#: the checked grammars (or error messages) and the schemas' problems, by a hash of their text
_GRAMMARS = DigestCache(len)
_SCHEMA_PROBLEMS = DigestCache(lambda problem: len(problem or ""))


def check_json_schema(schema: Any, param: str) -> None:
    """A 400 naming ``param`` unless ``schema`` is a JSON Schema: valid against the meta-schema of
    the draft its ``$schema`` names (2020-12 by default), within the size bounds of
    :func:`bounded_key` (checked first). Cached by a hash of the schema's text, as constraints are,
    so a schema sent with every request is checked once."""
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"Invalid JSON Schema in '{param}': not an object", param)
    problem = _SCHEMA_PROBLEMS.get(bounded_key(schema, param), _schema_problem)
    if problem is not None:
        raise RequestError(f"Invalid JSON Schema in '{param}': {problem[:500]}", param)


def constraint_key(constraint: dict[str, Any]) -> str:
    """The cache key of a constraint: its canonical JSON, within the size bounds (a 400 beyond)."""
    return bounded_key(constraint, f"structured_outputs.{constraint_kind(constraint)}")


def check(constraint: dict[str, Any]) -> str:
    """The checked grammar of ``constraint``; a 400 naming ``structured_outputs.<kind>`` when it is
    not valid (a bad schema, regex or grammar: the grammar engine's message; too large: the bound)."""
    kind = constraint_kind(constraint)
    grammar = _GRAMMARS.get(constraint_key(constraint), _checked)
    if grammar.startswith("\0"):
        raise RequestError(f"Invalid {kind.replace('_', ' ')} constraint: {grammar[1:][:2000]}", f"structured_outputs.{kind}")
    return grammar
