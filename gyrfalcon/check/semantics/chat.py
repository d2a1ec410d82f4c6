"""Promises of /v1/chat/completions alone: roles and conversations, content parts, logprobs by id,
tool calls and structured outputs."""

from __future__ import annotations

import json
import re

from gyrfalcon.check.registry import check
from gyrfalcon.check.semantics.completions import _exact_ids, logprob_ids
from gyrfalcon.check.semantics.flavours import CHAT as F
from gyrfalcon.check.semantics.flavours import by_index, expect
from gyrfalcon.check.semantics.ids import server_ids
from gyrfalcon.check.semantics.stream_shape import expect_choices, read_stream

PATH = F.path
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}  # fmt: skip
#: one call, greedy: a random model's sampled calls may run past any max_tokens
ONE_CALL = {"parallel_tool_calls": False, "temperature": 0.0}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _message(r: dict) -> dict:
    message = r["choices"][0].get("message")
    expect(isinstance(message, dict), f"no message: {str(r['choices'][0])[:200]}")
    return message


@check("chat")
def answer_is_the_assistants(target):
    """The answer's message has role "assistant"."""
    message = _message(target.ok(PATH, F.body(max_tokens=4)).json)
    expect(message.get("role") == "assistant", f"message role {message.get('role')!r}")


@check("chat")
def conversation_with_system_and_history(target):
    """A system message and earlier turns are accepted and answered."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to three."}]  # fmt: skip
    r = target.ok(PATH, {"messages": messages, "max_tokens": 6}).json
    F.text(r["choices"][0])


@check("chat", "content_parts")
def content_parts_equal_plain_text(target):
    """Content given as text parts is the same conversation as that text: the same greedy answer."""
    plain = F.text(target.ok(PATH, F.body("Tell me a joke", max_tokens=8, temperature=0.0)).json["choices"][0])
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me a joke"}]}],
             "max_tokens": 8, "temperature": 0.0}  # fmt: skip
    as_parts = F.text(target.ok(PATH, parts).json["choices"][0])
    expect(as_parts == plain, f"text parts answered {as_parts!r}, plain text {plain!r}")


@check("chat")
def no_logprobs_unless_asked(target):
    """Without logprobs, a choice's logprobs is null (or absent)."""
    r = target.ok(PATH, F.body(max_tokens=3)).json
    expect(r["choices"][0].get("logprobs") is None, f"logprobs nobody asked for: {str(r['choices'][0].get('logprobs'))[:200]}")


@check("chat", "max_completion_tokens")
def max_completion_tokens_respected(target):
    """max_completion_tokens (OpenAI's newer name) bounds the answer."""
    r = target.ok(PATH, F.body(max_completion_tokens=3, temperature=1.0, seed=9)).json
    expect(r["usage"]["completion_tokens"] <= 3, f"max_completion_tokens 3 gave {r['usage']['completion_tokens']} tokens")


@check("chat", "stream", "n")
def stream_role_comes_first(target):
    """Streamed with n = 2: each choice's first chunk names the role "assistant"."""
    stream = read_stream(target.ok(PATH, F.body(n=2, max_tokens=4, temperature=1.0, stream=True)), F.delta_text)
    expect_choices(stream, 2)
    first: dict[int, dict] = {}
    for chunk in stream.chunks:
        for c in chunk["choices"]:
            first.setdefault(c["index"], c.get("delta") or {})
    for index, delta in sorted(first.items()):
        expect(delta.get("role") == "assistant", f"choice {index}: first delta {delta}")


@check("chat", "logprob_token_ids", "n")
def logprob_token_ids_exact(target):
    """logprob_token_ids on chat: at every position of every choice (n = 2), exactly the sampled
    token and the ids asked for."""
    watched = server_ids(target).watched
    body = F.body("Name a colour.", max_tokens=5, n=2, temperature=1.0, **{**logprob_ids(watched), "logprobs": True, "top_logprobs": 0})
    r = target.ok(PATH, body).json
    for c in by_index(r, 2).values():
        _exact_ids(F.positions(c), watched, f"choice {c['index']}")


def _calls(message: dict) -> list[dict]:
    calls = message.get("tool_calls")
    expect(isinstance(calls, list) and calls, f"no tool_calls in {str(message)[:200]}")
    for call in calls:
        expect(isinstance(call.get("id"), str) and call.get("type") == "function", f"a tool call without id or type: {call}")
        expect(call["function"]["name"] == "get_weather", f"a call to an unknown tool: {call}")
        try:
            arguments = json.loads(call["function"]["arguments"])
        except ValueError:
            arguments = call["function"]["arguments"]
        expect(isinstance(arguments, dict) and isinstance(arguments.get("city"), str), f"arguments {arguments!r}")
    return calls


@check("chat", "tools", params=[("required", "required"), ("named", {"type": "function", "function": {"name": "get_weather"}})])
def tool_choice_forces_a_call(target, choice):
    """tool_choice "required" or a named function: the answer is a call to a declared tool with
    arguments that fit its parameters, finish_reason "tool_calls"."""
    r = target.ok(PATH, {"messages": ASK, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 200, **ONE_CALL}).json
    expect(r["choices"][0]["finish_reason"] == "tool_calls", f"finish_reason {r['choices'][0]['finish_reason']!r}")
    _calls(_message(r))


@check("chat", "tools", "stream")
def tool_call_streamed(target):
    """A required tool call streamed: OpenAI-shaped tool_calls deltas that join into the call."""
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 200, "stream": True, **ONE_CALL}
    stream = read_stream(target.ok(PATH, body), F.delta_text)
    expect_choices(stream, 1)
    expect(stream.finishes[0] == ["tool_calls"], f"finish_reason {stream.finishes[0]}")
    joined: dict[int, dict] = {}
    for chunk in stream.chunks:
        for c in chunk["choices"]:
            for d in (c.get("delta") or {}).get("tool_calls") or []:
                call = joined.setdefault(d["index"], {"id": None, "type": None, "function": {"name": "", "arguments": ""}})
                call["id"] = call["id"] or d.get("id")
                call["type"] = call["type"] or d.get("type")
                call["function"]["name"] += (d.get("function") or {}).get("name") or ""
                call["function"]["arguments"] += (d.get("function") or {}).get("arguments") or ""
    _calls({"tool_calls": [joined[i] for i in sorted(joined)]})


@check("chat", "tools")
def tool_result_continues(target):
    """A conversation carrying a call and its result back is answered."""
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21}'}]  # fmt: skip
    r = target.ok(PATH, {"messages": messages, "tools": [WEATHER], "max_tokens": 8}).json
    expect(r["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), f"finish_reason {r['choices'][0]['finish_reason']!r}")


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@check("chat", "response_format", params=[
    ("json_schema", {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}),
    ("json_object", {"type": "json_object"})])  # fmt: skip
def response_format_is_json(target, response_format):
    """response_format: a finished answer is JSON (valid against the schema); one cut by max_tokens
    is a prefix of such JSON."""
    r = target.ok(PATH, F.body("Answer in JSON.", max_tokens=40, response_format=response_format, temperature=0.0)).json
    content, finish = F.text(r["choices"][0]), r["choices"][0]["finish_reason"]
    if finish != "stop":
        expect(finish == "length", f"finish_reason {finish!r}")
        compact = "".join(content.split())  # the schema's JSON holds no string with a space
        if response_format["type"] == "json_schema":
            prefix = any(whole.startswith(compact) for whole in ('{"ok":true}', '{"ok":false}'))
        else:
            prefix = compact.startswith("{") or not compact
        expect(prefix, f"cut by max_tokens, {content!r} is not the beginning of such JSON")
        return
    import jsonschema

    try:
        value = json.loads(content)
        jsonschema.validate(value, SCHEMA if response_format["type"] == "json_schema" else {"type": "object"})
    except (ValueError, jsonschema.ValidationError) as exc:
        expect(False, f"finished (stop) with {content!r}: {str(exc).splitlines()[0]}")


@check("chat", "structured_outputs", params=[("choice", {"choice": ["yes", "no", "maybe"]}), ("regex", {"regex": "[0-9]{3}-[a-z]{2}"})])
def structured_outputs_hold(target, constraint):
    """vLLM's structured_outputs choice and regex: the answer is one of the choices / matches."""
    r = target.ok(PATH, F.body("Answer.", max_tokens=20, structured_outputs=constraint, temperature=1.0, seed=4)).json
    content = F.text(r["choices"][0])
    if "choice" in constraint:
        expect(content in constraint["choice"], f"{content!r} is none of {constraint['choice']}")
    else:
        expect(re.fullmatch(constraint["regex"], content), f"{content!r} does not match {constraint['regex']!r}")
