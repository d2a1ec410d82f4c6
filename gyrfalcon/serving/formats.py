"""Response shapes of each endpoint, built from engine outputs.

A :class:`Formatter` turns the final outputs of a request's engine streams into one response body,
and each streamed delta into chunks; choice ``j`` of prompt ``i`` is index ``i * n + j``.
"""

from __future__ import annotations

import time
from typing import Any

from gyrfalcon.engine.types import CompletionOutput, RequestOutput
from gyrfalcon.protocol.requests import ServingRequest


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


class Formatter:
    """Base: shapes shared by every endpoint; subclasses define the choice and envelope shapes."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, request: ServingRequest) -> None:
        self.request = request
        self.created = int(time.time())

    def index(self, prompt_index: int, choice: CompletionOutput) -> int:
        return prompt_index * self.request.n + choice.index

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return {
            "id": self.request.response_id,
            "object": self.chunk_object_name if chunk else self.object_name,
            "created": self.created,
            "model": self.request.model,
            "choices": choices,
        }

    # non-streaming ------------------------------------------------------------
    def final(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = [
            self.final_choice(i, output, choice) for i, output in enumerate(outputs) for choice in sorted(output.outputs, key=lambda c: c.index)
        ]
        body = self.envelope(choices, chunk=False)
        body["usage"] = usage(
            sum(len(o.prompt_token_ids) for o in outputs), sum(len(c.token_ids) for o in outputs for c in o.outputs)
        )
        return body

    def final_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        raise NotImplementedError

    # streaming ----------------------------------------------------------------
    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chunks sent before any token (chat: the role of every choice)."""
        return []

    def delta_chunks(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        choices = [
            self.delta_choice(prompt_index, output, choice)
            for choice in output.outputs
            if choice.text or choice.token_ids or choice.finish_reason
        ]
        return [self.envelope(choices, chunk=True)] if choices else []

    def delta_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        body = self.envelope([], chunk=True)
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body


class CompletionFormatter(Formatter):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, request: ServingRequest) -> None:
        super().__init__(request)
        self._echoed: set[int] = set()

    def _choice(self, index: int, text: str, choice: CompletionOutput) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def final_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        prefix = self.request.prompt_texts[prompt_index] if self.request.echo else ""
        body = self._choice(self.index(prompt_index, choice), prefix + choice.text, choice)
        if self.request.return_token_ids:
            body["token_ids"] = list(choice.token_ids)
            body["prompt_token_ids"] = list(output.prompt_token_ids)
        return body

    def delta_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        index = self.index(prompt_index, choice)
        text = choice.text
        if self.request.echo and index not in self._echoed:
            self._echoed.add(index)
            text = self.request.prompt_texts[prompt_index] + text
        body = self._choice(index, text, choice)
        if self.request.return_token_ids:
            body["token_ids"] = list(choice.token_ids)
        return body

    def prompt_only(self) -> dict[str, Any]:
        """echo with max_tokens 0: every choice is its prompt, nothing generated."""
        choices = []
        for i, request in enumerate(self.request.requests):
            for j in range(self.request.n):
                choice = {"index": i * self.request.n + j, "text": self.request.prompt_texts[i], "logprobs": None,
                          "finish_reason": "length", "stop_reason": None}
                if self.request.return_token_ids:
                    choice["token_ids"] = []
                    choice["prompt_token_ids"] = list(request.prompt_token_ids)
                choices.append(choice)
        body = self.envelope(choices, chunk=False)
        body["usage"] = usage(sum(len(r.prompt_token_ids) for r in self.request.requests), 0)
        return body


class ChatFormatter(Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def final_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        return {
            "index": self.index(prompt_index, choice),
            "message": {"role": "assistant", "content": choice.text},
            "logprobs": None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def opening_chunks(self) -> list[dict[str, Any]]:
        total = len(self.request.requests) * self.request.n
        choices = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(total)
        ]
        return [self.envelope(choices, chunk=True)]

    def delta_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        delta = {"content": choice.text} if choice.text else {}
        return {
            "index": self.index(prompt_index, choice),
            "delta": delta,
            "logprobs": None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }


class GenerateFormatter(Formatter):
    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return {
            "request_id": self.request.response_id,
            "model": self.request.model,
            "created": self.created,
            "choices": choices,
        }

    def _choice(self, prompt_index: int, choice: CompletionOutput) -> dict[str, Any]:
        return {
            "index": self.index(prompt_index, choice),
            "token_ids": list(choice.token_ids),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "logprobs": None,
        }

    def final(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        body = super().final(outputs)
        body["prompt_logprobs"] = None
        return body

    def final_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        return self._choice(prompt_index, choice)

    def delta_chunks(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        chunks = super().delta_chunks(prompt_index, output)
        for chunk in chunks:
            chunk["usage"] = None
        return chunks

    def delta_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        return self._choice(prompt_index, choice)


FORMATTERS: dict[str, type[Formatter]] = {
    "generate": GenerateFormatter,
    "completions": CompletionFormatter,
    "chat": ChatFormatter,
    "chat_batch": ChatFormatter,
}
