"""Response shapes of each endpoint, built from engine outputs.

A :class:`Formatter` turns the final outputs of a request's engine streams into one response body,
and each streamed delta into chunks; choice ``j`` of prompt ``i`` is index ``i * n + j``. Logprob
objects are rendered by :mod:`gyrfalcon.serving.logprob_formats` (which alternatives each endpoint
lists is documented there).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from gyrfalcon.engine_api.interface import Engine
from gyrfalcon.engine_api.types import CompletionOutput, RequestOutput, TokenLogprobs
from gyrfalcon.protocol.requests import ServingRequest
from gyrfalcon.protocol.tools import arguments_text
from gyrfalcon.serving.logprob_formats import (
    Listing,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    generate_logprobs,
    vllm_prompt_logprobs,
)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


class Formatter:
    """Base: shapes shared by every endpoint; subclasses define the choice and envelope shapes."""

    object_name = ""
    chunk_object_name = ""
    #: top-k mode also lists the position's own token (completions, generate; not chat)
    top_k_includes_own = True

    def __init__(self, request: ServingRequest, engine: Engine | None = None) -> None:
        self.request = request
        self.created = int(time.time())
        self.text = TokenText(engine, request.return_tokens_as_token_ids)
        self._generated: dict[int, int] = {}  # choice index -> tokens streamed so far

    def count_generated(self, prompt_index: int, output: RequestOutput) -> None:
        """Add a streamed output's new tokens to its choices' counts (continuous usage)."""
        for choice in output.outputs:
            index = self.index(prompt_index, choice)
            self._generated[index] = self._generated.get(index, 0) + len(choice.token_ids)

    def with_usage(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A one-choice chunk with the usage of its prompt and its choice so far (vLLM's
        ``continuous_usage_stats``)."""
        index = chunk["choices"][0]["index"]
        prompt = self.request.requests[index // self.request.n].prompt_token_ids
        chunk["usage"] = usage(len(prompt), self._generated.get(index, 0))
        return chunk

    # logprobs -----------------------------------------------------------------
    def wants_logprobs(self, prompt_index: int) -> bool:
        return self.request.requests[prompt_index].sampling.logprobs is not None

    def generated_listing(self, prompt_index: int) -> Listing:
        """Generated positions: exactly the gathered set with ``logprob_token_ids``, else top-k."""
        sampling = self.request.requests[prompt_index].sampling
        if sampling.logprob_token_ids:
            return Listing(None, include_own=True)
        return Listing(sampling.logprobs, include_own=self.top_k_includes_own)

    def prompt_listing(self, count: int | None) -> Listing:
        return Listing(count, include_own=True)

    def index(self, prompt_index: int, choice: CompletionOutput) -> int:
        return prompt_index * self.request.n + choice.index

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        body = {
            "id": self.request.response_id,
            "object": self.chunk_object_name if chunk else self.object_name,
            "created": self.created,
            "model": self.request.model,
            "choices": choices,
        }
        if chunk:
            body["usage"] = None  # the spec's chunks always carry it; only the final usage chunk fills it
        return body

    def _prompt_logprobs(self, output: RequestOutput) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs`` list for one prompt, or None when not asked."""
        if self.request.prompt_logprobs is None or output.prompt_logprobs is None:
            return None
        decoded = self.request.requests[0].sampling.detokenize
        return vllm_prompt_logprobs(self.text, output.prompt_logprobs, self.request.prompt_logprobs, decoded)

    # non-streaming ------------------------------------------------------------
    def final(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = [
            self._with_versions(self.final_choice(i, output, choice), choice)
            for i, output in enumerate(outputs) for choice in sorted(output.outputs, key=lambda c: c.index)
        ]
        body = self.envelope(choices, chunk=False)
        body["usage"] = usage(
            sum(len(o.prompt_token_ids) for o in outputs), sum(len(c.token_ids) for o in outputs for c in o.outputs)
        )
        return body

    def final_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        raise NotImplementedError

    def _with_versions(self, body: dict[str, Any], choice: CompletionOutput) -> dict[str, Any]:
        """A finished choice's ``weight_versions`` (where the request asks for them): each version
        of the weights that made its tokens, with the index of the first token it made."""
        if self.request.weight_versions and choice.finish_reason is not None and choice.weight_versions:
            body["weight_versions"] = [{"version": version, "start": start} for version, start in choice.weight_versions]
        return body

    # streaming ----------------------------------------------------------------
    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chunks sent before any token (chat: the role of every choice, one chunk each)."""
        return []

    def delta_chunks(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        """One chunk per choice with news (text, tokens or its finish), as OpenAI and vLLM stream:
        clients read ``chunk.choices[0]`` and must see every choice that way."""
        return [
            self.envelope([self._with_versions(self.delta_choice(prompt_index, output, choice), choice)], chunk=True)
            for choice in output.outputs
            if choice.text or choice.token_ids or choice.finish_reason
        ]

    def delta_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        raise NotImplementedError

    def closing_chunks(self, prompt_tokens: int, completion_tokens: int) -> list[dict[str, Any]]:
        """Chunks sent once every choice has ended (the Responses API's last event; none here)."""
        return []

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        body = self.envelope([], chunk=True)
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body


class CompletionFormatter(Formatter):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, request: ServingRequest, engine: Engine | None = None) -> None:
        super().__init__(request, engine)
        self._started: set[int] = set()  # choices that have sent a chunk
        self._offsets: dict[int, int] = {}  # per choice index: text_offset of its next token

    def _choice(self, index: int, text: str, choice: CompletionOutput) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "token_ids": None,  # vLLM's fields, always serialised (null unless asked for)
            "prompt_token_ids": None,
            "prompt_logprobs": None,
        }

    def _logprobs(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput, echo: bool) -> dict[str, Any] | None:
        """Echoed prompt positions (when ``echo``), then the choice's generated positions."""
        if not self.wants_logprobs(prompt_index):
            return None
        parts: list[tuple[TokenLogprobs, Listing]] = []
        if echo and output.prompt_logprobs is not None:
            parts.append((output.prompt_logprobs, self.prompt_listing(self.request.logprobs)))
        if choice.logprobs is not None:
            parts.append((choice.logprobs, self.generated_listing(prompt_index)))
        index = self.index(prompt_index, choice)
        body, self._offsets[index] = completion_logprobs(self.text, parts, self._offsets.get(index, 0))
        return body

    def final_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        prefix = self.request.prompt_texts[prompt_index] if self.request.echo else ""
        body = self._choice(self.index(prompt_index, choice), prefix + choice.text, choice)
        body["logprobs"] = self._logprobs(prompt_index, output, choice, self.request.echo)
        if self.request.return_token_ids:
            body["token_ids"] = list(choice.token_ids)
            body["prompt_token_ids"] = list(output.prompt_token_ids)
        if self.request.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(output)
        return body

    def delta_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        index = self.index(prompt_index, choice)
        text = choice.text
        first = index not in self._started
        self._started.add(index)
        if first and self.request.echo:
            text = self.request.prompt_texts[prompt_index] + text
        body = self._choice(index, text, choice)
        body["logprobs"] = self._logprobs(prompt_index, output, choice, first and self.request.echo)
        if self.request.return_token_ids:
            body["token_ids"] = list(choice.token_ids)
            if first:  # the prompt's ids once per choice, on its first chunk (as vLLM)
                body["prompt_token_ids"] = list(output.prompt_token_ids)
        return body

    def prompt_only(self) -> dict[str, Any]:
        """echo with max_tokens 0: every choice is its prompt, nothing generated."""
        choices = []
        for i, request in enumerate(self.request.requests):
            for j in range(self.request.n):
                choice = {"index": i * self.request.n + j, "text": self.request.prompt_texts[i], "logprobs": None,
                          "finish_reason": "length", "stop_reason": None, "token_ids": None,
                          "prompt_token_ids": None, "prompt_logprobs": None}  # fmt: skip
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
    top_k_includes_own = False

    def __init__(self, request: ServingRequest, engine: Engine | None = None) -> None:
        super().__init__(request, engine)
        self._held: dict[int, str] = {}  # choice index -> streamed text held back (a tool call may be starting)

    def _echoed(self, prompt_index: int) -> str:
        """The content ``echo`` puts first (the last turn's, when it has the reply's role)."""
        return self.request.prompt_texts[prompt_index] if self.request.echo else ""

    def _logprobs(self, prompt_index: int, choice: CompletionOutput) -> dict[str, Any] | None:
        if not self.wants_logprobs(prompt_index):
            return None
        logprobs = choice.logprobs if choice.logprobs is not None else TokenLogprobs()
        return chat_logprobs(self.text, logprobs, self.generated_listing(prompt_index))

    def final(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        body = super().final(outputs)
        one = not self.request.endpoint.batch  # one conversation: vLLM's place for its prompt's fields
        body["prompt_logprobs"] = self._prompt_logprobs(outputs[0]) if one else None
        body["prompt_token_ids"] = list(outputs[0].prompt_token_ids) if one and self.request.return_token_ids else None
        return body

    def _calls(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict[str, Any]], str | None]:
        """``(content, tool_calls, finish_reason)`` of a finished text: calls read by the request's
        parser (content null when the answer is only calls; ``tool_calls`` when it stopped on them)."""
        use = self.request.tools
        if use is None:
            return text, [], finish_reason
        content, calls = use.parser.parse(text, use.tools)
        if not calls:
            return text, [], finish_reason
        wire = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": call.name, "arguments": arguments_text(call.arguments)}} for call in calls]  # fmt: skip
        return content or None, wire, "tool_calls" if finish_reason == "stop" else finish_reason

    def final_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        content, calls, finish_reason = self._calls(choice.text, choice.finish_reason)
        echoed = self._echoed(prompt_index)
        body = {
            "index": self.index(prompt_index, choice),
            "message": {"role": "assistant", "content": (echoed + (content or "")) or None if calls else echoed + content,
                        "reasoning_content": None, "tool_calls": calls},  # fmt: skip
            "logprobs": self._logprobs(prompt_index, choice),
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
            "token_ids": list(choice.token_ids) if self.request.return_token_ids else None,
        }
        if self.request.endpoint.batch:  # per conversation
            if self.request.prompt_logprobs is not None:
                body["prompt_logprobs"] = self._prompt_logprobs(output)
            if self.request.return_token_ids:
                body["prompt_token_ids"] = list(output.prompt_token_ids)
        return body

    def opening_chunks(self) -> list[dict[str, Any]]:
        chunks = []
        for i, request in enumerate(self.request.requests):
            for j in range(self.request.n):
                chunk = self.envelope([{"index": i * self.request.n + j, "delta": {"role": "assistant", "content": self._echoed(i)},
                                        "logprobs": None, "finish_reason": None, "stop_reason": None}], chunk=True)  # fmt: skip
                if self.request.return_token_ids:
                    chunk["prompt_token_ids"] = list(request.prompt_token_ids)
                chunks.append(chunk)
        return chunks

    def _tool_delta(self, index: int, choice: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """A streamed choice's delta with tools: text that cannot start a call goes out at once; from a
        possible call's start on, the text is held until the choice ends, then read as calls."""
        use = self.request.tools
        assert use is not None
        held = self._held.get(index, "") + choice.text
        if choice.finish_reason is None:
            cut = use.parser.holds_back(held)
            self._held[index] = held[cut:]
            return ({"content": held[:cut]} if cut else {}), None
        self._held.pop(index, None)
        content, calls, finish_reason = self._calls(held, choice.finish_reason)
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        return delta, finish_reason

    def delta_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        index = self.index(prompt_index, choice)
        if self.request.tools is None:
            delta, finish_reason = ({"content": choice.text} if choice.text else {}), choice.finish_reason
        else:
            delta, finish_reason = self._tool_delta(index, choice)
        body = {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(prompt_index, choice) if choice.token_ids else None,
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if self.request.return_token_ids:
            body["token_ids"] = list(choice.token_ids)
        return body


class GenerateFormatter(Formatter):
    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        body = {
            "request_id": self.request.response_id,
            "model": self.request.model,
            "created": self.created,
            "choices": choices,
        }
        if chunk:
            body["usage"] = None
            body["prompt_logprobs"] = None  # prompt_logprobs are refused when streaming
        return body

    def _choice(self, prompt_index: int, choice: CompletionOutput) -> dict[str, Any]:
        logprobs = None
        if self.wants_logprobs(prompt_index):
            lp = choice.logprobs if choice.logprobs is not None else TokenLogprobs()
            logprobs = generate_logprobs(lp, self.generated_listing(prompt_index))
        return {
            "index": self.index(prompt_index, choice),
            "token_ids": list(choice.token_ids),
            "text": choice.text if self.request.requests[prompt_index].sampling.detokenize else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "logprobs": logprobs,
        }

    def final(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        body = super().final(outputs)
        body["prompt_logprobs"] = self._prompt_logprobs(outputs[0]) if outputs else None
        body["kv_transfer_params"] = None  # vLLM always sends it
        return body

    def final_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        return self._choice(prompt_index, choice)

    def delta_choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        return self._choice(prompt_index, choice)
