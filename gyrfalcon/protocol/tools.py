"""The request's constraint: ``structured_outputs`` or ``response_format`` (:func:`structured_constraint`),
and ``tools``, ``tool_choice`` and ``parallel_tool_calls`` → a :class:`ToolUse`, its constraint, and the
conversation as the model should see it.

- ``tool_choice`` ``none`` (the default without tools): nothing is rendered or parsed;
- ``auto`` (the default with tools): the tools are rendered, calls in the answer are parsed;
- ``required`` / a named function: the answer is constrained to calls (the parser's grammar, each
  call's arguments following the tool's ``parameters``).

A chat template that does not render ``tools`` gets the parser's instructions as a system message,
and the conversation's tool calls and tool turns in the parser's convention (assistant and user
text), so a model whose template knows nothing of tools still sees the whole exchange.
"""

from __future__ import annotations

import json
from typing import Any

from gyrfalcon.errors import RequestError
from gyrfalcon.protocol.requests import ToolUse
from gyrfalcon.protocol.rules import RequestFields
from gyrfalcon.structured.grammar import check_json_schema


def tool_use(f: RequestFields, body: dict[str, Any], parser: Any) -> ToolUse | None:
    """The request's tool use, or None (no tools, or ``tool_choice`` none). Tool schemas are taken
    from the body as sent (a ``null`` inside a schema means something)."""
    choice = f.get("tool_choice")
    if not f.has("tools"):
        if choice not in (None, "none"):
            raise f.error("tool_choice", "'tool_choice' needs 'tools'")
        return None
    tools = [{"type": "function", "function": {k: v for k, v in tool["function"].items() if v is not None}}
             for tool in body["tools"]]  # fmt: skip
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise f.error("tools", "two tools have the same name")
    for i, tool in enumerate(tools):  # whatever tool_choice is: a bad schema is refused, as OpenAI does
        if "parameters" in tool["function"]:
            check_json_schema(tool["function"]["parameters"], f"tools.{i}.function.parameters")
    if choice == "none":
        return None
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise RequestError(f"tool_choice names '{name}', which is not among the tools", "tool_choice.function.name")
        choice = name
    if parser is None:
        raise f.error("tools", "this server has no tool-call parser")
    return ToolUse(tools, choice or "auto", f.get("parallel_tool_calls", True) is not False, parser)


def tool_constraint(use: ToolUse | None, f: RequestFields, constraint: dict[str, Any] | None) -> dict[str, Any] | None:
    """The request's ``structured_outputs``: the calls' grammar for ``required`` or a named function
    (which no other constraint may join), else ``constraint`` as it was."""
    if use is None or use.choice == "auto":
        return constraint
    if constraint is not None:
        raise f.error("tool_choice", f"tool_choice '{use.choice}' constrains the answer to tool calls: it cannot be "
                                     "combined with response_format or structured_outputs")  # fmt: skip
    if use.choice == "required":
        return {"grammar": use.parser.grammar(use.tools, use.parallel)}
    one = [tool for tool in use.tools if tool["function"]["name"] == use.choice]
    return {"grammar": use.parser.grammar(one, False)}


def with_instructions(messages: list[dict[str, Any]], use: ToolUse) -> list[dict[str, Any]]:
    """Template messages for a template that does not render tools: the parser's instructions in the
    system message, past calls and tool results written in the parser's convention."""
    text = use.parser.instructions(use.tools)
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message.pop("tool_calls")]
            message["content"] = "\n".join(part for part in (message.get("content") or "", use.parser.render_calls(calls)) if part)
        elif message["role"] == "tool":
            message = {"role": "user", "content": use.parser.render_result(str(message.get("content") or ""))}
        out.append(message)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}".strip()}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def arguments_text(arguments: dict[str, Any]) -> str:
    """A call's arguments as OpenAI sends them: a JSON text."""
    return json.dumps(arguments, ensure_ascii=False)


def structured_constraint(f: RequestFields, body: dict[str, Any]) -> dict[str, Any] | None:
    """``SamplingParams.structured_outputs`` from ``structured_outputs`` or ``response_format`` (not
    both). JSON schemas are taken from the body as sent: a ``null`` inside a schema means something."""
    response_format = f.get("response_format") or {"type": "text"}
    if f.has("structured_outputs"):
        if response_format["type"] != "text":
            raise f.error("structured_outputs", "'structured_outputs' and 'response_format' cannot be used together")
        sent = f.endpoint.nested_body(body)
        return {k: v for k, v in sent["structured_outputs"].items() if v is not None}
    if response_format["type"] == "json_object":
        return {"json_object": True}
    if response_format["type"] == "json_schema":
        return {"json": body["response_format"]["json_schema"].get("schema") or {}}
    return None
