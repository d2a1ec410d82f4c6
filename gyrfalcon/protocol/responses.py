"""OpenAI's Responses API on the chat pipeline: a request's fields as chat's, and chat's names back.

:func:`as_chat` turns the fields of a validated ``ResponsesRequest`` into the fields of a chat
request — ``instructions`` a system turn, the stored conversation of ``previous_response_id`` next,
then the ``input`` items (a ``function_call`` item an assistant's tool call, a
``function_call_output`` item a tool turn), ``max_output_tokens`` as ``max_tokens``, ``text.format``
as ``response_format``, the flat function tools as chat's — and refuses what this server cannot
honour (``reasoning``, ``truncation: auto``, hosted tools, ``include`` other than logprobs, a
background response that is streamed or not stored) by name. Every later step (rules, capabilities, limits, rendering, sampling) is chat's;
:class:`ChatNames` names a refusal's field as the Responses request wrote it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gyrfalcon.errors import RequestError

#: the one ``include`` this server honours
LOGPROBS_INCLUDE = "message.output_text.logprobs"

#: fields with the same name and meaning on both sides
SAME = ("model", "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "ignore_eos", "stream", "parallel_tool_calls",
        "top_logprobs", "logprob_token_ids", "metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier",
        "request_id", "cache_salt", "priority", "extensions")  # fmt: skip


@dataclass
class ChatNames:
    """Chat's field names of one converted request → the Responses request's own."""

    #: chat message index → (where it came from, the input item index or None)
    messages: list[tuple[str, int | None]] = field(default_factory=list)
    #: (chat message index, tool call index) → input item index
    calls: dict[tuple[int, int], int] = field(default_factory=dict)

    def __call__(self, param: str | None) -> str | None:
        """``param`` of the chat request as the Responses request wrote it."""
        if param is None:
            return None
        if param == "max_tokens":
            return "max_output_tokens"
        if param == "logprobs":
            return "include"
        if param.startswith("response_format"):
            return "text.format.schema" if param.startswith("response_format.json_schema.schema") else "text.format"
        if param == "tool_choice.function.name":
            return "tool_choice.name"
        match = re.fullmatch(r"tools\.(\d+)\.function\.(.+)", param)
        if match:
            return f"tools.{match[1]}.{match[2]}"
        if param.startswith("messages"):
            return self._message(param)
        return param

    def _message(self, param: str) -> str:
        match = re.fullmatch(r"messages\.(\d+)(?:\.(.*))?", param)
        if match is None or int(match[1]) >= len(self.messages):
            return "input"
        index, rest = int(match[1]), match[2]
        origin, item = self.messages[index]
        if origin != "input" or item is None:
            return origin
        call = re.fullmatch(r"tool_calls\.(\d+)\.function\.(.+)", rest or "")
        if call and (index, int(call[1])) in self.calls:
            return f"input.{self.calls[index, int(call[1])]}.{call[2]}"
        if rest in ("tool_call_id",):
            return f"input.{item}.call_id"
        return f"input.{item}" + (f".{rest}" if rest and not rest.startswith("tool_calls") else "")


def refuse_unsupported(values: dict[str, Any]) -> None:
    """A 400 naming each field this server cannot honour (sent with another value than its default)."""
    if values.get("background") is True and values.get("store") is False:
        raise RequestError("A background response is stored: 'background' needs 'store' true", "background")
    if values.get("background") is True and values.get("stream") is True:
        raise RequestError("A background response is not streamed here: poll GET /v1/responses/{id}", "stream")
    if values.get("reasoning") is not None:
        raise RequestError("'reasoning' is not supported: the served model has no reasoning template", "reasoning")
    if values.get("truncation") == "auto":
        raise RequestError("'truncation': 'auto' is not supported: a conversation that does not fit is refused", "truncation")
    for i, item in enumerate(values.get("include") or []):
        if item != LOGPROBS_INCLUDE:
            raise RequestError(f"include '{item}' is not supported by this server (only {LOGPROBS_INCLUDE})", f"include.{i}")
    for i, tool in enumerate(values.get("tools") or []):
        if tool.get("type") != "function":
            raise RequestError(f"The hosted tool '{tool.get('type')}' is not available on this server", f"tools.{i}.type")


def as_chat(values: dict[str, Any], history: list[dict[str, Any]]) -> tuple[dict[str, Any], ChatNames]:
    """The chat request of a Responses request's ``values`` (sent fields, or the raw body: nulls are
    kept as they came), after the stored turns ``history``; and the names back."""
    names = ChatNames()
    messages: list[dict[str, Any]] = []
    if values.get("instructions") is not None:
        messages.append({"role": "system", "content": values["instructions"]})
        names.messages.append(("instructions", None))
    for message in history:
        messages.append(dict(message))
        names.messages.append(("previous_response_id", None))
    _append_input(values["input"], messages, names)
    chat: dict[str, Any] = {name: values[name] for name in SAME if name in values}
    chat["messages"] = messages
    if values.get("max_output_tokens") is not None:
        chat["max_tokens"] = values["max_output_tokens"]
    include = values.get("include") or []
    if LOGPROBS_INCLUDE in include or (values.get("top_logprobs") or 0) > 0:
        chat["logprobs"] = True
    text_format = (values.get("text") or {}).get("format")
    if text_format is not None:
        chat["response_format"] = _response_format(text_format)
    if values.get("tools") is not None:
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
                         for tool in values["tools"]]  # fmt: skip
    choice = values.get("tool_choice")
    if isinstance(choice, dict):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    return chat, names


def _response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    if text_format["type"] != "json_schema":
        return {"type": text_format["type"]}
    inner = {k: text_format[k] for k in ("name", "description", "schema", "strict") if k in text_format}
    return {"type": "json_schema", "json_schema": inner}


def _append_input(given: Any, messages: list[dict[str, Any]], names: ChatNames) -> None:
    """The input's items as chat turns: consecutive function calls join one assistant turn."""
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        names.messages.append(("input", None))
        return
    for i, item in enumerate(given):
        kind = item.get("type") or "message"
        if kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and names.messages[-1][0] == "input":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                names.messages.append(("input", i))
            names.calls[len(messages) - 1, len(messages[-1]["tool_calls"]) - 1] = i
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            names.messages.append(("input", i))
        else:
            content = item["content"]
            if not isinstance(content, str):
                content = [{"type": "text", "text": part["text"]} for part in content]
            messages.append({"role": item["role"], "content": content})
            names.messages.append(("input", i))


def input_items(values: dict[str, Any], new_id: Any) -> list[dict[str, Any]]:
    """The input as a list of items with ids (what ``GET /v1/responses/{id}/input_items`` lists);
    ``new_id(prefix)`` names an item sent without one."""
    given = values["input"]
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    items = []
    for item in given:
        item = {k: v for k, v in item.items() if v is not None}
        kind = item.setdefault("type", "message")
        if kind == "message":
            content = item["content"]
            if isinstance(content, str):
                content = [{"type": "input_text" if item["role"] != "assistant" else "output_text", "text": content}]
            item["content"] = [{"type": part["type"], "text": part["text"]} for part in content]
            item.setdefault("status", "completed")
        item.setdefault("id", new_id({"message": "msg", "function_call": "fc", "function_call_output": "fco"}[kind]))
        items.append(item)
    return items
