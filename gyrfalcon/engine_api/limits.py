"""Every bound of a request field: the documents' keywords, the deployment's limits, the vocabulary rule.

The documents state each field's range and sizes; ``python -m gyrfalcon.codegen`` writes those
keywords into ``generated/field_bounds.py`` (``openapi/served.py:request_field_keywords``), read
here (:func:`field_keywords`, :func:`field_range`, :func:`keyword_refusal`), so the engine process
reads Python data, never YAML, and restates no bound. A request that came through the API had them
decided on the wire (the generated models); an engine request built without it (benchmarks, tests)
has them decided by :meth:`gyrfalcon.validation.RequestValidator.check_bounds` from the same keywords.
A field must be bounded alike wherever the documents state it (an error at its first use otherwise).

Each :class:`FieldLimit` names the request fields it bounds, how (:class:`Reach`) and the bound a
deployment's :class:`ServedLimits` gives it. The translator refuses a value sent beyond it with
:meth:`FieldLimit.check` (a 400 naming the field, or the item inside it, and stating the bound);
:class:`gyrfalcon.validation.RequestValidator` applies the same table to an engine request built
without the API (benchmarks, tests), and :mod:`gyrfalcon.openapi.limits` lays it over the served
spec. So what the served spec calls valid is exactly what the code accepts; a test sends every bound
and one past it to prove it.

The vocabulary rule is here too (a token id is an integer in ``[0, vocab_size)``): only the engine
knows the vocabulary's size (``EngineInfo.vocab_size``), and this table, the validator and the
plugins that take token ids all ask here, so the rule and its message are stated once.

Pure Python: importable by the HTTP frontend and the engine process alike, without torch.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from gyrfalcon.generated.field_bounds import FIELD_KEYWORDS, ITEM_KEYWORDS


def is_token_id(value: Any, vocab_size: int) -> bool:
    """Whether ``value`` is a token id of a vocabulary of ``vocab_size`` (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def first_outside_vocabulary(ids: Iterable[Any], vocab_size: int) -> Any | None:
    """The first of ``ids`` that is not a token id of a vocabulary of ``vocab_size``, or None."""
    return next((t for t in ids if not is_token_id(t, vocab_size)), None)


def outside_vocabulary(token_id: Any, param: str, vocab_size: int) -> str:
    """The message of a token id outside the vocabulary."""
    return f"Token id {token_id!r} in '{param}' is outside the vocabulary (size {vocab_size})"


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


def item_refusal(values: Any, param: str) -> tuple[str, str] | None:
    """The first of ``values`` (a field's array) that is not a string of the lengths the documents
    give the items of request field ``param`` (:data:`ITEM_KEYWORDS`), as ``(param of the item,
    message)``; None when every item keeps them, or the documents bound none (or bound them
    differently in two schemas: the wire decided those)."""
    keywords = ITEM_KEYWORDS.get(param)
    if not keywords or not isinstance(values, (list, tuple)):
        return None
    least, most = keywords.get("minLength", 0), keywords.get("maxLength")
    for i, item in enumerate(values):
        if not isinstance(item, str) or len(item) < least:
            return f"{param}.{i}", (f"{param} must be non-empty strings" if least == 1 else
                                    f"{param} must be strings of at least {least} characters")  # fmt: skip
        if most is not None and len(item) > most:
            return f"{param}.{i}", f"{param} must be strings of at most {most} characters"
    return None


@dataclass
class ServedLimits:
    """This deployment's limits, enforced by :data:`FIELD_LIMITS` and laid over the bundled spec by ``served_spec``.

    ``unsupported`` holds wire field names the engine cannot honour; names that occur in no request
    schema are ignored. ``extensions`` maps a plugin name to the JSON-Schema fragment of its field.
    """

    model_names: list[str]
    vocab_size: int
    max_model_len: int
    max_request_seqs: int
    max_logprobs: int = 20
    unsupported: set[str] = field(default_factory=set)
    extensions: dict[str, dict] = field(default_factory=dict)
    #: most prompts (completions) or conversations (batch chat) one request may carry; None: no cap
    max_prompts: int | None = None

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.max_model_len < 2 or self.max_request_seqs < 1 or self.max_logprobs < 0:
            raise ValueError(f"impossible limits: {self!r}")


class Reach(enum.Enum):
    """What of a field's value a limit bounds."""

    #: the integer itself (``maximum``)
    VALUE = "value"
    #: every integer inside (token ids: ``maximum`` on each)
    TOKEN_IDS = "token_ids"
    #: every token-id array inside (a prompt as ids: ``maxItems``)
    ID_ARRAY_LENGTH = "id_array_length"
    #: the list of prompts or conversations (``maxItems``)
    PROMPT_COUNT = "prompt_count"
    #: the object's keys, token ids as decimals (``propertyNames``)
    ID_KEYS = "id_keys"


@dataclass(frozen=True)
class FieldLimit:
    """``fields`` hold at most :meth:`bound` (``why`` says whose limit it is) where ``reach`` says."""

    fields: frozenset[str]
    reach: Reach
    bound: Callable[[ServedLimits], int | None]
    why: str

    def check(self, value: Any, limits: ServedLimits, param: str) -> tuple[str, str] | None:
        """``(param, message)`` of the 400 for a sent ``value`` beyond the bound (the param is the
        field's, or names the item inside it), or None when it is within."""
        most = self.bound(limits)
        if most is None or value is None:
            return None
        if self.reach is Reach.VALUE:
            if _is_int(value) and value > most:
                return _refusal(param, f"'{param}' must be at most {most} ({self.why})")
        elif self.reach is Reach.TOKEN_IDS:
            for path, token_id in _ints_inside(value, param):
                if not 0 <= token_id <= most:
                    return _refusal(path, outside_vocabulary(token_id, path, most + 1))
        elif self.reach is Reach.ID_ARRAY_LENGTH:
            for path, ids in _id_arrays_inside(value, param):
                if len(ids) > most:
                    return _refusal(path, f"'{path}' holds {len(ids)} token ids; at most {most} ({self.why})")
        elif self.reach is Reach.PROMPT_COUNT:
            if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value) and len(value) > most:
                return _refusal(param, f"At most {most} prompts per request on this server, got {len(value)}")
        elif self.reach is Reach.ID_KEYS:
            for key in value:
                if not 0 <= int(key) <= most:
                    return _refusal(param, outside_vocabulary(key, param, most + 1))
        return None


#: Integer request fields counting log-probabilities.
LOGPROB_COUNT_FIELDS = frozenset({"logprobs", "top_logprobs", "prompt_logprobs"})
#: Request fields bounded by the context less one (min_tokens <= max_tokens <= max_model_len - 1).
MAX_TOKENS_FIELDS = frozenset({"max_tokens", "max_completion_tokens", "max_output_tokens"})

#: The table: every deployment bound of a request field, in one place.
FIELD_LIMITS: tuple[FieldLimit, ...] = (
    FieldLimit(frozenset({"n"}), Reach.VALUE, lambda lim: lim.max_request_seqs, "the server's max_request_seqs"),
    FieldLimit(MAX_TOKENS_FIELDS | {"min_tokens"}, Reach.VALUE, lambda lim: lim.max_model_len - 1,
               "this model's context less one"),  # fmt: skip
    FieldLimit(LOGPROB_COUNT_FIELDS, Reach.VALUE, lambda lim: lim.max_logprobs, "the server's max_logprobs"),
    FieldLimit(frozenset({"token_ids", "prompt", "tokens", "stop_token_ids", "allowed_token_ids", "logprob_token_ids"}),
               Reach.TOKEN_IDS, lambda lim: lim.vocab_size - 1, "the vocabulary"),  # fmt: skip
    FieldLimit(frozenset({"logit_bias"}), Reach.ID_KEYS, lambda lim: lim.vocab_size - 1, "the vocabulary"),
    FieldLimit(frozenset({"token_ids", "prompt", "tokens"}), Reach.ID_ARRAY_LENGTH, lambda lim: lim.max_model_len,
               "this model's context"),  # fmt: skip
    FieldLimit(frozenset({"prompt", "messages"}), Reach.PROMPT_COUNT, lambda lim: lim.max_prompts,
               "the server's prompts per request"),  # fmt: skip
)


def limits_of(name: str) -> Iterator[FieldLimit]:
    """The table's entries that bound field ``name``."""
    return (limit for limit in FIELD_LIMITS if name in limit.fields)


def longest_array(limits: ServedLimits, spec_max_items: int) -> int:
    """The most items any array of any request may hold on this deployment: a longer one is refused
    before the body is walked (``spec_max_items``: the largest fixed ``maxItems`` of the documents)."""
    return max(limits.max_model_len, limits.max_prompts or 0, spec_max_items)


def largest_object(limits: ServedLimits, spec_max_properties: int) -> int:
    """The most keys any object of any request may hold on this deployment: a larger one is refused
    before the body is walked. ``logit_bias`` may hold a key per token of the vocabulary; every other
    map has a fixed ``maxProperties`` in the documents (``spec_max_properties``: the largest)."""
    return max(limits.vocab_size, spec_max_properties)


# ---------------------------------------------------------------------- helpers


def _refusal(param: str, message: str) -> tuple[str, str]:
    return param, message


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints_inside(value: Any, path: str) -> Iterator[tuple[str, int]]:
    """Every integer in a (nested) list, with the param naming the list that holds it."""
    if _is_int(value):
        yield path, value
    elif isinstance(value, list):
        nested = any(isinstance(v, list) for v in value)
        for i, item in enumerate(value):
            yield from _ints_inside(item, f"{path}.{i}" if nested else path)


def _id_arrays_inside(value: Any, path: str) -> Iterator[tuple[str, list[int]]]:
    """Every list of integers in a value (itself, or the lists of a list), with its param."""
    if isinstance(value, list) and value and all(_is_int(v) for v in value):
        yield path, value
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, list) and item and all(_is_int(v) for v in item):
                yield f"{path}.{i}", item
