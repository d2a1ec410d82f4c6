"""Tool-call parsers: how a model writes a call, how that is constrained, and how it is read back.

A parser runs on the API side on text (never in the step loop). It knows one convention:

- :meth:`ToolCallParser.instructions` — a system prompt describing the tools and the convention,
  for chat templates that do not render ``tools`` themselves;
- :meth:`ToolCallParser.grammar` — a Lark grammar (llguidance's dialect) for ``tool_choice``
  ``required`` or a named function: only calls to those tools, their arguments following each
  tool's ``parameters`` schema;
- :meth:`ToolCallParser.parse` — the content and the calls in a finished text;
- :meth:`ToolCallParser.holds_back` — where, in a streamed text, a call may be starting (what
  follows is held until the choice ends).

Plugins offer more through ``gyrfalcon_tool_parsers``; ``--tool-call-parser`` picks one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gyrfalcon.structured.grammar import with_json_format


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


def _call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """JSON schema of one call ``{"name": …, "arguments": {…}}`` to any of ``tools``."""
    options = []
    for tool in tools:
        function = tool["function"]
        parameters = function.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                        "required": ["name", "arguments"], "additionalProperties": False})  # fmt: skip
    return with_json_format(options[0] if len(options) == 1 else {"anyOf": options})


def _as_call(value: Any) -> ToolCall | None:
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if isinstance(arguments, dict):
            return ToolCall(value["name"], arguments)
    return None


class ToolCallParser:
    """Base class of a tool-call convention (see the module docstring)."""

    name = ""

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        raise NotImplementedError

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        raise NotImplementedError

    def parse(self, text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
        """``(content, calls)``: the text outside the calls, and the calls to one of ``tools`` (a
        malformed call, or one to a tool not offered, stays in the content)."""
        raise NotImplementedError

    def holds_back(self, text: str) -> int:
        """The offset in ``text`` from which a call may be starting (``len(text)``: none)."""
        raise NotImplementedError

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """Past calls (``{"name", "arguments"}``) as the model writes them, for templates without tools."""
        raise NotImplementedError

    def render_result(self, content: str) -> str:
        """A tool's result as the next user turn says it, for templates without tool turns."""
        return content


def _signatures(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, one tag per call (Hermes, Qwen)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return ("You can call functions. Their signatures, one JSON object per line, are inside <tools></tools>:\n"
                f"<tools>\n{_signatures(tools)}\n</tools>\n"
                "To call one, answer with a JSON object holding its name and arguments inside <tool_call></tool_call> "
                'tags, one pair of tags per call:\n<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>')  # fmt: skip

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        repeat = "+" if parallel else ""
        schema = json.dumps(_call_schema(tools))
        return (f'start: call{repeat}\ncall: "{self.OPEN}\\n" body "\\n{self.CLOSE}"\n'
                f"body: %json {schema}\n")  # fmt: skip

    def parse(self, text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
        offered = {tool["function"]["name"] for tool in tools}
        calls: list[ToolCall] = []
        content: list[str] = []
        end = 0
        for match in self._CALL.finditer(text):
            try:
                call = _as_call(json.loads(match.group(1)))
            except ValueError:
                call = None
            if call is None or call.name not in offered:
                continue
            content.append(text[end:match.start()])
            end = match.end()
            calls.append(call)
        content.append(text[end:])
        return "".join(content).strip() if calls else text, calls

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{self.OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{self.CLOSE}" for call in calls)

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def holds_back(self, text: str) -> int:
        start = text.find(self.OPEN)
        if start >= 0:
            return start
        for size in range(min(len(self.OPEN) - 1, len(text)), 0, -1):  # a tag cut by the stream
            if self.OPEN.startswith(text[-size:]):
                return len(text) - size
        return len(text)


class JsonParser(ToolCallParser):
    """The whole answer is one call as a bare JSON object, or a JSON list of them."""

    name = "json"

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return ("You can call functions. Their signatures, one JSON object per line:\n"
                f"{_signatures(tools)}\n"
                'To call one, answer only with a JSON object {"name": "<function name>", "arguments": {<arguments>}}, '
                "or a JSON list of such objects for several calls.")  # fmt: skip

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        call = _call_schema(tools)
        schema = with_json_format({"type": "array", "items": call, "minItems": 1}) if parallel else call
        return f"start: %json {json.dumps(schema)}\n"

    def parse(self, text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
        offered = {tool["function"]["name"] for tool in tools}
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        calls = [_as_call(v) for v in (value if isinstance(value, list) else [value])]
        if not calls or any(c is None or c.name not in offered for c in calls):
            return text, []
        return "", [c for c in calls if c is not None]

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)

    def holds_back(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped[:1] in ("{", "[") or not stripped else len(text)


BUILTIN_PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser(), "json": JsonParser()}
