"""Chat conversations as the model's template renders them: the request's template options, wire
messages turned into template messages, and the checks that nothing sent is silently dropped
(the runtime rules ``message_fields_match_role``, ``tool_call_arguments_json``,
``message_name_rendered``, ``message_tool_calls_rendered``, ``chat_template_renders``,
``continue_final_message_alone``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson

from gyrfalcon.engine_api.interface import Engine
from gyrfalcon.errors import RequestError
from gyrfalcon.protocol.requests import ToolUse
from gyrfalcon.protocol.rules import RequestFields
from gyrfalcon.protocol.tools import with_instructions


class ChatRenderer:
    """Renders conversations into token ids with an engine's chat template and tokenizer."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._tools: bool | None = None

    def renders_tools(self) -> bool:
        """Whether the model's chat template renders ``tools`` (probed once)."""
        if self._tools is None:
            probe = [{"role": "user", "content": "x"}]
            tool = {"type": "function", "function": {"name": "probe_tool", "parameters": {"type": "object"}}}
            try:
                self._tools = (self.engine.apply_chat_template(probe, True, template_kwargs={"tools": [tool]})
                                       != self.engine.apply_chat_template(probe, True))  # fmt: skip
            except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
                self._tools = False
        return self._tools

    def render(self, messages: list[dict[str, Any]], options: ChatRendering, param: str,
                     tools: ToolUse | None = None) -> list[int]:  # fmt: skip
        """Token ids of wire chat messages rendered with the model's template (its special tokens once,
        unless ``add_special_tokens`` asks for the tokenizer's too), with the request's tools."""
        plain = [template_message(m, f"{param}.{i}") for i, m in enumerate(messages)]
        kwargs = options.template_kwargs
        if tools is not None:
            if self.renders_tools():
                kwargs = {**kwargs, "tools": tools.tools}
            else:  # the template knows nothing of tools: the parser's convention, in plain turns
                plain = with_instructions(plain, tools)

        def render(msgs: list[dict[str, str]]) -> str:
            return self.engine.apply_chat_template(msgs, options.add_generation_prompt,
                                                   continue_final_message=options.continue_final_message,
                                                   template_kwargs=kwargs)  # fmt: skip

        try:
            text = render(plain)
            for key, what in (("name", "message names"), ("tool_calls", "tool calls")):
                holders = [i for i, m in enumerate(plain) if key in m]
                if holders and render([{k: v for k, v in m.items() if k != key} for m in plain]) == text:
                    raise RequestError(f"This model's chat template does not render {what}; '{key}' would be ignored",
                                       f"{param}.{holders[0]}.{key}")  # fmt: skip
            tools = [i for i, m in enumerate(plain) if m["role"] == "tool"]
            others = [m for m in plain if m["role"] != "tool"]
            if tools and others and render(others) == text:
                raise RequestError("This model's chat template does not render tool turns; they would be ignored",
                                   f"{param}.{tools[0]}.role")  # fmt: skip
        except RequestError:
            raise
        except Exception as exc:  # a template raising on these messages is the client's 400
            raise RequestError(f"The chat template cannot render these messages: {exc}", param) from None
        return self.engine.tokenize(text, add_special_tokens=options.add_special_tokens)


#: chat template arguments a request's chat_template_kwargs may not override
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "conversation", "tools", "documents", "chat_template", "tokenize",
                                    "add_generation_prompt", "continue_final_message", "return_dict",
                                    "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs"})  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ChatRendering:
    """How a request's conversations are rendered (the chat endpoints' template options)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def echoed(self, messages: list[dict[str, Any]]) -> str:
        """What ``echo`` puts before each choice's content: the last turn's content when it has the
        reply's role (assistant; without a generation prompt, the reply continues the last turn)."""
        last = messages[-1]
        if self.add_generation_prompt and last["role"] != "assistant":
            return ""
        content = last.get("content") or ""
        return content if isinstance(content, str) else "\n".join(part["text"] for part in content)

    @classmethod
    def of(cls, f: RequestFields) -> ChatRendering:
        if f.get("continue_final_message") is True and f.get("add_generation_prompt") is not False:
            # runtime-only (continue_final_message_alone): one more if/then made the chat schema too
            # complex for Schemathesis' generator
            raise f.error("continue_final_message",
                          "'continue_final_message' continues the last message: it needs 'add_generation_prompt': false")  # fmt: skip
        kwargs = dict(f.get("chat_template_kwargs") or {})
        for key in kwargs:
            if key in RESERVED_TEMPLATE_ARGS:
                raise f.error("chat_template_kwargs", f"'chat_template_kwargs' may not set the template's own argument '{key}'")
        return cls(f.get("add_generation_prompt", True), f.get("continue_final_message", False),
                   f.get("add_special_tokens", False), kwargs)  # fmt: skip


#: message fields only one role may carry
ROLE_ONLY_FIELDS = {"tool_calls": "assistant", "reasoning_content": "assistant", "tool_call_id": "tool"}


def template_message(message: dict[str, Any], param: str) -> dict[str, Any]:
    """A wire chat message as chat templates expect it (the runtime rule message_fields_match_role).

    ``developer`` becomes ``system``; text parts are joined by newlines; an assistant turn without
    content gets ``""`` (templates concatenate it); tool-call arguments are parsed from their JSON
    text, as vLLM hands them to Hugging Face templates.
    """
    role = message["role"]
    content = message.get("content")
    for key, owner in ROLE_ONLY_FIELDS.items():
        if message.get(key) is not None and role != owner:
            raise RequestError(f"'{key}' belongs to {owner} messages, not to a {role} message", f"{param}.{key}")
    if role == "tool" and message.get("tool_call_id") is None:
        raise RequestError("A tool message needs the 'tool_call_id' of the call it answers", f"{param}.tool_call_id")
    if content is None and role != "assistant":
        raise RequestError(f"A {role} message needs 'content'", f"{param}.content")
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    plain: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content or ""}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if message.get(key) is not None:
            plain[key] = message[key]
    if message.get("tool_calls"):
        plain["tool_calls"] = [_template_tool_call(call, f"{param}.tool_calls.{j}") for j, call in enumerate(message["tool_calls"])]
    return plain


def _template_tool_call(call: dict[str, Any], param: str) -> dict[str, Any]:
    try:  # orjson: a decode error past 1024 levels, never a RecursionError
        arguments = orjson.loads(call["function"]["arguments"])
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"Tool call arguments must be a JSON text: {exc}", f"{param}.function.arguments") from None
    return {"id": call["id"], "type": call["type"], "function": {"name": call["function"]["name"], "arguments": arguments}}
