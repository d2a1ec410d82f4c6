"""Requests no server can honour: each is a 400 whose error names the offending param (OpenAI's
``error.param``), never a 200 that ignores it and never a 500."""

from __future__ import annotations

from typing import Any

from gyrfalcon.check.registry import check
from gyrfalcon.check.semantics.ids import server_ids
from gyrfalcon.check.target import refused

HUGE = 10**9
COMPLETIONS = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

#: (name, path, body, param): the body replaces or adds fields of the endpoint's minimal request
INVALID: list[tuple[str, str, dict[str, Any], str]] = [
    ("completions n 0", "/v1/completions", {"n": 0}, "n"),
    ("completions n not a number", "/v1/completions", {"n": "three"}, "n"),
    ("completions max_tokens -1", "/v1/completions", {"max_tokens": -1}, "max_tokens"),
    ("completions max_tokens beyond any context", "/v1/completions", {"max_tokens": HUGE, "stream": True}, "max_tokens"),
    ("completions temperature -0.5", "/v1/completions", {"temperature": -0.5}, "temperature"),
    ("completions top_p 1.5", "/v1/completions", {"top_p": 1.5}, "top_p"),
    ("completions logprobs -1", "/v1/completions", {"logprobs": -1}, "logprobs"),
    ("completions presence_penalty 3", "/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("completions frequency_penalty -3", "/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("completions stream_options without stream", "/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions prompt missing", "/v1/completions", {"prompt": None, "max_tokens": 2}, "prompt"),
    ("completions prompt id beyond the vocabulary", "/v1/completions", {"prompt": [HUGE]}, "prompt"),
    ("completions logit_bias key not a token id", "/v1/completions", {"logit_bias": {"not-an-id": 1}}, "logit_bias"),
    ("chat messages empty", "/v1/chat/completions", {"messages": []}, "messages"),
    ("chat role unknown", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("chat top_logprobs without logprobs", "/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat top_logprobs 50", "/v1/chat/completions", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("chat n 0", "/v1/chat/completions", {"n": 0}, "n"),
    ("chat temperature -1", "/v1/chat/completions", {"temperature": -1}, "temperature"),
    ("chat max_completion_tokens -1", "/v1/chat/completions", {"max_completion_tokens": -1}, "max_completion_tokens"),
    ("chat stream_options without stream", "/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat tool parameters not a JSON Schema", "/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nonsense"}}}]}, "tools"),  # OpenAI: tools[0].function.parameters
    ("chat tool_choice naming no tool", "/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("generate token_ids empty", "/inference/v1/generate", {"token_ids": []}, "token_ids"),
    ("generate token id beyond the vocabulary", "/inference/v1/generate", {"token_ids": [HUGE]}, "token_ids"),
]  # fmt: skip

_BASE = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT,
         "/inference/v1/generate": {"token_ids": None, "sampling_params": {"max_tokens": 2}}}  # fmt: skip


@check("errors", params=[(name, (path, body, param)) for name, path, body, param in INVALID])
def invalid_is_a_400_naming_its_param(target, case):
    """An invalid value or combination is a 400 whose error.param names the field."""
    path, body, param = case
    base = _BASE[path] if path != "/inference/v1/generate" else {**_BASE[path], "token_ids": server_ids(target).prompt}
    request = {"model": target.model, **base, **body}
    # streamed requests are peeked at: a server that accepts max_tokens 10^9 is not kept generating
    refused(target.post(path, {k: v for k, v in request.items() if v is not None}, peek=bool(body.get("stream"))), param)
