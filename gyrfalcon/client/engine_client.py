"""``EngineClient``: the frontend's :class:`Engine` over an :class:`EngineCore` (see the package)."""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from typing import Any

from gyrfalcon.client.choice import ChoiceText, IncrementalDetokenizer, NoText
from gyrfalcon.client.metrics import RequestTimer, serving_metrics
from gyrfalcon.engine_api.interface import Engine, EngineCore, OutputStream
from gyrfalcon.client.aggregator import OutputAggregator
from gyrfalcon.engine_api.types import (EngineHealth, EngineInfo, EngineRequest, OutputKind, PauseState, RequestOutput,
                                       SleepState)  # fmt: skip


class ClientStream(OutputStream):
    """A request's outputs with text, in its own output kind, made from the core's token-id deltas
    in the consumer's thread. A choice whose text hits a stop string is finished at once here and
    in the core (which drops it at its next step); closing the stream aborts the core request."""

    def __init__(self, request: EngineRequest, core_stream: OutputStream, choices: list[ChoiceText], core: EngineCore,
                 timer: RequestTimer | None = None) -> None:  # fmt: skip
        super().__init__(request.request_id)
        self.core_stream = core_stream
        self._core = core
        self._state = OutputAggregator(request, choices)
        self._done = False
        self._timer = timer

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output, None at the end. With a ``timeout``, it waits at most that long for
        the core and then takes only what is already queued: ``queue.Empty`` means no output is
        ready yet (the core's progress so far is applied), so a reader of several streams can take
        turns even while a non-streaming request has nothing to return."""
        wait = timeout
        while not self._done:
            item = self.core_stream.get(wait)
            if item is None:
                self._done = True
                return None
            output = self._apply(item)
            if output is not None:
                return output
            if timeout is not None:
                wait = 0
        return None

    def _apply(self, item: RequestOutput) -> RequestOutput | None:
        timer, state = self._timer, self._state
        if timer is not None:
            timer.output(item)
        if item.error is not None:
            self._done = True
            if timer is not None:
                timer.failed()
            return state.fail(item.error)
        if item.prompt_logprobs is not None:
            state.prompt_logprobs = item.prompt_logprobs
        for delta in item.outputs:
            choice = state.sequences[delta.index]
            if choice.add(delta):
                self._core.finish_choice(self.request_id, delta.index, choice.stop_reason)
        output = state.make_output()
        if state.finished:
            self._done = True
            if timer is not None:
                timer.finish([choice.finish_reason for choice in state.sequences], state.num_generated_tokens())
        return output

    def set_waker(self, waker: Any) -> None:
        # outputs are made as the stream is read: the core's items are what wake the reader
        self.core_stream.set_waker(waker)

    def close(self) -> None:
        self._done = True
        if self._state.finished:
            # every choice ended here or in the core: the core finishes the last ones (stop strings)
            # at its next step; an abort now would count a finished request as aborted
            self.core_stream.set_waker(None)
            return
        self.core_stream.close()


class EngineClient(Engine):
    """Tokenizer, chat template, detokenizer and stop strings around ``core``; every other call
    goes to the core. ``tokenizer``: the served model's (when None, loaded from
    ``core.info().model_path`` at its first use: a client whose core alone is served, as in the
    engine process, never loads it); ``model_name`` labels its request metrics."""

    def __init__(self, core: EngineCore, tokenizer: Any = None, *, model_name: str | None = None,
                 metrics: bool = True) -> None:  # fmt: skip
        self.core = core
        self._tokenizer = tokenizer
        self._tokenizer_lock = threading.Lock()
        self._token_bytes = None  # gyrfalcon.client.token_bytes.TokenBytes, built on first use
        #: request metrics (prometheus-client, this process's), labelled with ``model_name`` (default:
        #: the model folder's name); False: not counted
        self._metrics = metrics
        self._model_name = model_name

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer (loaded at the first use when none was given)."""
        if self._tokenizer is None:
            from gyrfalcon.models.loading import load_tokenizer

            with self._tokenizer_lock:
                if self._tokenizer is None:
                    self._tokenizer = load_tokenizer(self.core.info().model_path)
        return self._tokenizer

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The tokenizer's special token ids (what ``skip_special_tokens`` leaves out)."""
        return frozenset(self.tokenizer.all_special_ids)

    # ------------------------------------------------------------------ the core's calls

    def info(self) -> EngineInfo:
        return self.core.info()

    def health(self) -> EngineHealth:
        return self.core.health()

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    def finish_choice(self, request_id: str, index: int, stop_reason: str | int | None = None) -> None:
        self.core.finish_choice(request_id, index, stop_reason)

    def shutdown(self, grace: float = 5.0) -> None:
        self.core.shutdown(grace)

    def drain(self, timeout: float) -> None:
        self.core.drain(timeout)

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> PauseState:
        return self.core.pause(mode, clear_cache)

    def resume(self) -> PauseState:
        return self.core.resume()

    def pause_state(self) -> PauseState:
        return self.core.pause_state()

    def abort_requests(self, group_ids: list[str] | None = None) -> int:
        return self.core.abort_requests(group_ids)

    def update_weights(self, model_path: str, weight_version: str | None = None, flush_cache: bool = True) -> str:
        return self.core.update_weights(model_path, weight_version, flush_cache)

    def sleep(self, level: int = 1) -> SleepState:
        return self.core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> SleepState:
        return self.core.wake_up(tags)

    def sleep_state(self) -> SleepState:
        return self.core.sleep_state()

    def load_lora_adapter(self, lora_name: str, lora_path: str, load_inplace: bool = False) -> None:
        self.core.load_lora_adapter(lora_name, lora_path, load_inplace)

    def unload_lora_adapter(self, lora_name: str) -> None:
        self.core.unload_lora_adapter(lora_name)

    def lora_adapters(self) -> list[list[str]]:
        return self.core.lora_adapters()

    def wait_ready(self, timeout: float = 60.0, poll_s: float = 0.01) -> EngineHealth:
        """Block until the core is ready (or ``timeout`` seconds); returns its health."""
        deadline = time.monotonic() + timeout
        health = self.core.health()
        while not health.ready and time.monotonic() < deadline and not health.message.startswith("model failed"):
            time.sleep(poll_s)
            health = self.core.health()
        return health

    def submit(self, request: EngineRequest) -> OutputStream:
        core_stream = self.core.submit(dataclasses.replace(request, output_kind=OutputKind.DELTA))
        params = request.sampling
        choices = [ChoiceText(index, params, self._detokenizer(request)) for index in range(params.n)]
        return ClientStream(request, core_stream, choices, self.core, self._timer(request))

    @property
    def model_name(self) -> str:
        """The ``model_name`` label of this engine's metrics."""
        return self._model_name or os.path.basename(os.path.normpath(self.core.info().model_path))

    def _timer(self, request: EngineRequest) -> RequestTimer | None:
        if not self._metrics:
            return None
        metrics = serving_metrics(self.core.info().max_model_len)
        return metrics.timer(self.model_name, len(request.prompt_token_ids), request.sampling.n)

    # ------------------------------------------------------------------ text

    def _detokenizer(self, request: EngineRequest) -> IncrementalDetokenizer | NoText:
        params = request.sampling
        if not params.detokenize:
            return NoText()
        return IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, self.special_ids,
                                      params.skip_special_tokens, params.spaces_between_special_tokens)  # fmt: skip

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    @functools.cache  # noqa: B019 - one client per process, one value
    def longest_token_chars(self) -> int | None:
        """The longest token string of the vocabulary (added tokens included): a byte-level or
        SentencePiece token's string has at least as many characters as the text it spells."""
        return max((len(piece) for piece in self.tokenizer.get_vocab()), default=0) or None

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)  # fmt: skip

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                for t in token_ids]  # fmt: skip

    def token_pieces(self, token_ids: list[int]) -> list[str]:
        return [str(piece) for piece in self.tokenizer.convert_ids_to_tokens(list(token_ids))]

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        if self._token_bytes is None:  # logprob path: the tokenizer's own byte mapping
            from gyrfalcon.client.token_bytes import TokenBytes

            self._token_bytes = TokenBytes(self.tokenizer)
        return self._token_bytes(token_ids)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> str:  # fmt: skip
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message,
                                                  **(template_kwargs or {}))  # fmt: skip
