"""Which engine capability each wire field needs: what the validator decides "not supported" on.

A wire field maps to the engine capability that honours it: by default the ``SamplingParams`` field
of the same name; a few wire fields need a capability of another name; fields handled entirely by
the frontend (prompt, stream, echo, …) need none. :func:`wire_asks` lists what a request asks;
:meth:`gyrfalcon.validation.RequestValidator.check_supported` refuses what the engine lacks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from gyrfalcon.engine_api.types import SamplingParams
from gyrfalcon.protocol.rules import RequestFields
from gyrfalcon.validation import Ask

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


def wire_asks(fields: RequestFields, defaults: dict[str, Any]) -> list[Ask]:
    """What a request's wire fields ask of the engine, in the body's order: each field that needs a
    capability and holds something other than its wire default (``defaults``: the documented ones;
    absent, any value asks) or a value that asks for nothing; each extension by its name."""
    asks: list[Ask] = []
    for name, value in fields.values.items():
        if name == "extensions":
            asks += [(ext, f"extensions.{ext}", f"extensions.{ext}") for ext in value or {}]
            continue
        cap = capability_of(name)
        if cap is None:
            continue
        if (name in defaults and value == defaults[name]) or (name in NEUTRAL_VALUES and value == NEUTRAL_VALUES[name]):
            continue
        asks.append((cap, name, fields.param(name)))
    return asks
