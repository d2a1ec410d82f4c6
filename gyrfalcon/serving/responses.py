"""The Responses API's shapes: the ``Response`` object, and its event stream.

A Responses request runs as a chat request with one choice (:mod:`gyrfalcon.protocol.responses`);
this formatter presents that choice as OpenAI's Responses API does: a ``message`` output item with
one ``output_text`` part, and a ``function_call`` item per tool call read from the answer. Streamed,
the events are ``response.created``, ``response.in_progress``, then for the message
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta`` …,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``, for
each call ``response.output_item.added``, ``response.function_call_arguments.delta`` and ``.done``,
``response.output_item.done``, and last ``response.completed`` (or ``response.incomplete``) with
the whole response; every event carries its ``sequence_number``.
"""

from __future__ import annotations

import uuid
from typing import Any

from gyrfalcon.engine_api.interface import Engine
from gyrfalcon.engine_api.types import CompletionOutput, RequestOutput, TokenLogprobs
from gyrfalcon.protocol.requests import ServingRequest
from gyrfalcon.serving.formats import ChatFormatter
from gyrfalcon.serving.logprob_formats import chat_logprobs

#: the request fields a response echoes, with the value that stands for "not sent"
ECHOED = {"instructions": None, "max_output_tokens": None, "temperature": 1.0, "top_p": 1.0, "tools": [],
          "tool_choice": "auto", "parallel_tool_calls": True, "text": {"format": {"type": "text"}}, "top_logprobs": 0,
          "truncation": "disabled", "store": True, "background": False, "metadata": {}, "user": None,
          "previous_response_id": None}  # fmt: skip


def new_id(prefix: str) -> str:
    """An item id in OpenAI's style (``msg_…``, ``fc_…``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormatter(ChatFormatter):
    """The one choice of a Responses request as a ``Response`` and as its events."""

    def __init__(self, request: ServingRequest, engine: Engine | None = None) -> None:
        super().__init__(request, engine)
        self.sequence = 0
        self.message_id = new_id("msg")
        self.opened = False  # the message item and its part were announced
        self.text_so_far = ""
        self.logprobs_so_far: list[dict[str, Any]] = []
        self.items: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        #: the whole response, once its last event is made (what the store keeps)
        self.response: dict[str, Any] | None = None
        #: the finished choice, once it is (its weight versions go on the finished response)
        self.finished: CompletionOutput | None = None

    # the response object -----------------------------------------------------
    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        fields = self.request.response_fields
        body: dict[str, Any] = {
            "id": self.request.response_id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.request.model, "output": output, "usage": usage,
        }  # fmt: skip
        for name, unset in ECHOED.items():
            body[name] = fields.get(name, unset)
        return body if self.finished is None else self._with_versions(body, self.finished)

    @staticmethod
    def usage(prompt: int, generated: int) -> dict[str, Any]:
        """The Responses API's usage object of ``prompt`` input and ``generated`` output tokens."""
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": generated,
                "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + generated}  # fmt: skip

    def _status(self, finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def _message(self, text: str, logprobs: list[dict[str, Any]] | None, status: str) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": [part]}

    @staticmethod
    def _call(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        function = call["function"]
        return {"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"], "status": status}  # fmt: skip

    def _entries(self, choice: CompletionOutput) -> list[dict[str, Any]] | None:
        """The choice's logprob entries (chat's), or None when not asked."""
        if not self.wants_logprobs(0):
            return None
        logprobs = choice.logprobs if choice.logprobs is not None else TokenLogprobs()
        return chat_logprobs(self.text, logprobs, self.generated_listing(0))["content"]

    def final(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choice = self.finished = outputs[0].outputs[0]
        content, calls, _ = self._calls(choice.text, choice.finish_reason)
        status = self._status(choice.finish_reason)
        output = [self._message(content or "", self._entries(choice), status)] if content or not calls else []
        output += [self._call(call) for call in calls]
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        self.response = self.body(status, output, self.usage(prompt, sum(len(c.token_ids) for o in outputs for c in o.outputs)))
        return self.response

    # the events ----------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening_chunks(self) -> list[dict[str, Any]]:
        started = self.body("in_progress", [], None)
        return [self.event("response.created", response=started), self.event("response.in_progress", response=started)]

    def _open(self) -> list[dict[str, Any]]:
        if self.opened:
            return []
        self.opened = True
        return [self.event("response.output_item.added", output_index=0, item=self._message("", None, "in_progress") | {"content": []}),
                self.event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": []})]  # fmt: skip

    def delta_chunks(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for choice in output.outputs:
            if self.request.tools is None:
                text, finish = choice.text, choice.finish_reason
                calls: list[dict[str, Any]] = []
            else:
                delta, finish = self._tool_delta(0, choice)
                text, calls = delta.get("content") or "", delta.get("tool_calls") or []
            entries = self._entries(choice) if choice.token_ids else None
            if entries is not None:
                self.logprobs_so_far += entries
            if text:
                events += self._open()
                self.text_so_far += text
                events.append(self.event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                         content_index=0, delta=text, logprobs=entries or []))  # fmt: skip
            if choice.finish_reason is not None:
                self.finish_reason, self.finished = choice.finish_reason, choice
                events += self._closing_items(calls)
        return events

    def _closing_items(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        status = self._status(self.finish_reason)
        events: list[dict[str, Any]] = []
        if self.opened or not calls:
            events += self._open()
            logprobs = self.logprobs_so_far if self.wants_logprobs(0) else None
            message = self._message(self.text_so_far, logprobs, status)
            part = message["content"][0]
            events += [
                self.event("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0,
                           text=self.text_so_far, logprobs=self.logprobs_so_far),
                self.event("response.content_part.done", item_id=self.message_id, output_index=0, content_index=0, part=part),
                self.event("response.output_item.done", output_index=0, item=message),
            ]  # fmt: skip
            self.items.append(message)
        for call in calls:
            item = self._call(call)
            index = len(self.items)
            events += [
                self.event("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"]),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item),
            ]  # fmt: skip
            self.items.append(item)
        return events

    def closing_chunks(self, prompt_tokens: int, completion_tokens: int) -> list[dict[str, Any]]:
        status = self._status(self.finish_reason)
        self.response = self.body(status, self.items, self.usage(prompt_tokens, completion_tokens))
        return [self.event("response.completed" if status == "completed" else "response.incomplete", response=self.response)]


def conversation_after(serving: ServingRequest, response: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat turns a later ``previous_response_id`` continues: the stored history, this
    request's input turns and the answer (its text and calls one assistant turn)."""
    turns = list(serving.history) + list(serving.input_turns)
    text = "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in response["output"] if item["type"] == "function_call"]  # fmt: skip
    answer: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        answer["tool_calls"] = calls
    elif answer["content"] is None:
        answer["content"] = ""
    turns.append(answer)
    return turns

