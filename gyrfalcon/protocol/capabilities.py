"""Which request fields this deployment can honour: the rest are refused with 400, never ignored.

A wire field maps to the engine capability that honours it: by default the ``SamplingParams`` field
of the same name; a few wire fields need a capability of another name; fields handled entirely by
the frontend (prompt, stream, echo, …) need none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from gyrfalcon.engine_api.types import SamplingParams
from gyrfalcon.protocol.rules import RequestFields
from gyrfalcon.validation import not_supported

_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))

#: wire fields whose capability has another name
WIRE_CAPABILITY: dict[str, str] = {
    "top_logprobs": "logprobs",
    "return_tokens_as_token_ids": "logprobs",
    "max_completion_tokens": "max_tokens",
    "use_beam_search": "use_beam_search",
    "cache_salt": "cache_salt",
    "priority": "priority",
    "store": "store",  # no engine stores completions: only the default (false) is accepted
    "suffix": "suffix",  # no engine inserts text: only the default (null) is accepted
    "response_format": "structured_outputs",
    # SGLang's fields that vllm-router sends with their defaults: no engine here honours another value
    "no_stop_trim": "no_stop_trim",
    "return_hidden_states": "return_hidden_states",
    "separate_reasoning": "reasoning_parser",
    "stream_reasoning": "reasoning_parser",
    "include_reasoning": "reasoning_parser",
}

#: values of wire fields without a documented default that ask for nothing (any engine honours them)
NEUTRAL_VALUES: dict[str, Any] = {"response_format": {"type": "text"}}


def capability_of(wire_field: str) -> str | None:
    """The engine capability a wire field needs, or None when the frontend handles it alone."""
    if wire_field in WIRE_CAPABILITY:
        return WIRE_CAPABILITY[wire_field]
    if wire_field in _SAMPLING_FIELDS:
        return wire_field
    return None


def unsupported_fields(wire_fields: Iterable[str], capabilities: frozenset[str]) -> set[str]:
    """The wire fields (of a request schema) that this engine cannot honour."""
    return {name for name in wire_fields if (cap := capability_of(name)) is not None and cap not in capabilities}


def check_supported(fields: RequestFields, defaults: dict[str, Any], capabilities: frozenset[str]) -> None:
    """Refuse a field the engine cannot honour, unless the client sent exactly its wire default.

    ``defaults`` maps wire field names to their documented default (absent: no default, so any
    value counts as asking for it). Extensions are checked by name against the capabilities too.
    """
    for name, value in fields.values.items():
        if name == "extensions":
            for ext in value or {}:
                if ext not in capabilities:
                    raise not_supported(f"extensions.{ext}")
            continue
        cap = capability_of(name)
        if cap is None or cap in capabilities:
            continue
        if (name in defaults and value == defaults[name]) or (name in NEUTRAL_VALUES and value == NEUTRAL_VALUES[name]):
            continue
        raise not_supported(name, fields.param(name))
