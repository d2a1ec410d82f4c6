"""Schemathesis hooks of `gyrfalcon check`'s schema phase: the contract's runtime-rule filter, and a
cap on the tokens a positive case asks for, so that the phase takes minutes on a real model on a
CPU (the semantic checks cover long generations; the schema phase covers the request space).

The cap comes from ``GYRFALCON_CHECK_MAX_TOKENS`` (set by :func:`gyrfalcon.check.schema.run_schema`).
"""

from __future__ import annotations

import os
from typing import Any

import schemathesis

from gyrfalcon.contract import filter_case  # noqa: F401  (registers the runtime-rule filter)

MAX_TOKENS_ENV = "GYRFALCON_CHECK_MAX_TOKENS"
_FIELDS = ("max_tokens", "max_completion_tokens")


def cap_tokens(params: dict[str, Any], cap: int, absent_means_context: bool) -> None:
    """At most ``cap`` new tokens (never below ``min_tokens``); set where leaving it out means up to
    the context (chat, batch chat, generate)."""
    floor = params.get("min_tokens") if isinstance(params.get("min_tokens"), int) else 0
    limit = max(cap, floor)
    present = [name for name in _FIELDS if params.get(name) is not None]
    if not present and absent_means_context:
        params["max_tokens"] = limit
    for name in present:
        value = params[name]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit:
            params[name] = limit


@schemathesis.hook
def before_call(context: Any, case: Any, **kwargs: Any) -> None:
    """Cap a positive case's tokens (negative cases go out as generated)."""
    meta = getattr(case, "meta", None)
    cap = int(os.environ.get(MAX_TOKENS_ENV, "0") or 0)
    if cap <= 0 or meta is None or meta.generation.mode != schemathesis.GenerationMode.POSITIVE:
        return
    path, body = case.operation.path, case.body
    if not isinstance(body, dict):
        return
    if path.endswith("/generate"):
        if body.get("sampling_params") is None:
            body["sampling_params"] = {}  # null is "not set": the same request
        cap_tokens(body["sampling_params"], cap, absent_means_context=True)
    elif path.endswith(("/completions", "/batch")):
        cap_tokens(body, cap, absent_means_context="/chat/" in path)
