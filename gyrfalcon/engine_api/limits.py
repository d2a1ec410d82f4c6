"""The deployment limits of request fields and the vocabulary rule: one table, decided once a request.

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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
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
