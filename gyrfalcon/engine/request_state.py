"""A request inside the engine core: its choices' sequences, its stream and its scheduling state.

The core speaks token ids: after each step a request reports, for every choice that changed, the
ids and logprobs it gained since its last report, and a choice's finish once (DELTA outputs, no
text). The client turns them into text in the request's own output kind
(:class:`~gyrfalcon.client.aggregator.OutputAggregator`).

When a choice stops on token ids (vLLM semantics; stop strings are the client's, which tells the
core to stop a choice that hit one), checked after every generated token, in this order:

1. eos (unless ``ignore_eos``) or a ``stop_token_ids`` member → ``"stop"`` (stop_reason None for
   eos, the token id otherwise); both only once ``min_tokens`` tokens exist;
2. ``max_tokens`` reached or the context full → ``"length"``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gyrfalcon.engine_api.interface import OutputStream
from gyrfalcon.engine_api.outputs import ChoiceProgress
from gyrfalcon.engine_api.types import (
    CompletionOutput, EngineError, EngineRequest, RequestOutput, SamplingParams, TokenLogprobs,
)  # fmt: skip


class StopChecker:
    """The token-id stop rules of one choice."""

    def __init__(self, params: SamplingParams, eos_token_ids: list[int], prompt_len: int, max_model_len: int) -> None:
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.prompt_len = prompt_len
        self.max_model_len = max_model_len

    def check_token(self, token_id: int, num_generated: int) -> tuple[str, int | None] | None:
        """``("stop", stop_reason)`` when ``token_id`` ends the choice, else None."""
        if num_generated < self.params.min_tokens:
            return None
        if token_id in self.stop_token_ids:
            return "stop", token_id
        if token_id in self.eos_token_ids:
            return "stop", None
        return None

    def check_length(self, num_generated: int) -> bool:
        """True when ``max_tokens`` are generated or the context is full."""
        return num_generated >= self.params.max_tokens or self.prompt_len + num_generated >= self.max_model_len


class Sequence(ChoiceProgress):
    """Choice ``index`` of a request. :meth:`append` applies the token-id stop rules (stop strings
    are the engine client's: it finishes the choice through the engine when one is hit).

    KV state (kept by the scheduler): ``blocks`` is the block table, ``computed`` how many of the
    sequence's tokens (prompt, then generated) have their KV in those blocks, ``block_hashes`` the
    prefix-cache keys of its full computed blocks. ``seed`` keys the sampling noise of every
    position (the request's child seed, or one drawn for it), so a recomputed sequence draws the
    same tokens.
    """

    #: the core produces no text: outputs carry token ids, the client decodes them
    text = ""

    def __init__(self, index: int, params: SamplingParams, prompt_token_ids: list[int], stopper: StopChecker,
                 seed: int = 0, weight_version: str = "") -> None:  # fmt: skip
        super().__init__(index)
        #: which weights make which tokens: ``[version, first token index]`` pairs, in order
        self.weight_versions: list[list[Any]] = [[weight_version, 0]]
        self._versions_sent = 0
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.stopper = stopper
        self.seed = seed
        self.blocks: list[int] = []
        self.computed = 0
        self.block_hashes: list[bytes] = []
        #: the scheduler's weights epoch when this sequence's KV began (its prefix-cache keys carry it)
        self.cache_epoch = 0
        #: the LoRA adapter its rows run with (:class:`~gyrfalcon.engine.lora.peft.LoraAdapter`, in a
        #: slot: set when the scheduler admits it; None: the base model's, or not admitted yet)
        self.lora: Any = None

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens."""
        return len(self.prompt_token_ids) + len(self.token_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens ``start .. stop - 1`` of the prompt followed by the generated tokens."""
        prompt = len(self.prompt_token_ids)
        if stop <= prompt:
            return self.prompt_token_ids[start:stop]
        if start >= prompt:
            return self.token_ids[start - prompt : stop - prompt]
        return [*self.prompt_token_ids[start:], *self.token_ids[: stop - prompt]]

    def weights_replaced(self, version: str) -> None:
        """The weights are ``version`` from this choice's next token on (a no-op once finished)."""
        if self.finished:
            return
        start = len(self.token_ids)
        if self.weight_versions[-1][1] == start:  # nothing made by the weights before
            self.weight_versions[-1][0] = version
        else:
            self.weight_versions.append([version, start])

    def versions_to_send(self) -> list[list[Any]] | None:
        """The weight versions for this choice's next output: all of them when they changed since
        the last output (the first one included) or the choice has finished, else None."""
        if not self.finished and self._versions_sent == len(self.weight_versions):
            return None
        self._versions_sent = len(self.weight_versions)
        return [list(span) for span in self.weight_versions]

    def visible_text(self) -> str:
        return ""

    def append(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        """Add a generated token and decide whether the choice has finished."""
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.add_logprobs(logprobs)
        count = len(self.token_ids)
        token_stop = self.stopper.check_token(token_id, count)
        if token_stop is not None:
            self.finish(*token_stop)
        elif self.stopper.check_length(count):
            self.finish("length")


def choices_of(request: EngineRequest, eos_token_ids: list[int], max_model_len: int, seeds: torch.Generator,
               weight_version: str = "") -> list[Sequence]:  # fmt: skip
    """The ``n`` sequences of ``request``, each with its seed: the request's child seed, or for an
    unseeded choice one drawn from ``seeds``, so that a recomputed choice draws the same tokens;
    ``weight_version``: the weights served now."""
    params = request.sampling
    sequences = []
    for index in range(params.n):
        seed = params.child_seed(index)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=seeds))
        stopper = StopChecker(params, eos_token_ids, len(request.prompt_token_ids), max_model_len)
        sequences.append(Sequence(index, params, request.prompt_token_ids, stopper, seed, weight_version))
    return sequences


class RequestState:
    """The core's side of a request (see the module docstring)."""

    def __init__(self, request: EngineRequest, stream: OutputStream, sequences: list[Sequence]) -> None:
        self.request = request
        self.sequences = sequences
        self.stream = stream
        #: per choice: how many of its tokens were reported, and whether its finish was
        self._sent_tokens = [0] * len(sequences)
        self._sent_finish = [False] * len(sequences)
        #: the prompt's logprobs, when asked for (reported with the next output)
        self.prompt_logprobs: TokenLogprobs | None = None
        self.abort_requested = False
        self.closed = False
        #: choices the client finished (a stop string): index -> stop reason, applied at the next step
        self.finish_requested: dict[int, str | int | None] = {}
        #: prompt positions whose logprobs are gathered (the next chunk starts here)
        self.prompt_logprobs_done = 0
        #: True once the ``n`` children run on their own (after the first token); before, only
        #: choice 0 is scheduled: the prompt is prefilled once for all of them
        self.forked = False
        #: arrival number, given when the scheduler first queues it (orders equal priorities)
        self.arrival = 0
        #: monotonic times it was submitted and first scheduled (its queue time)
        self.submitted_at = time.monotonic()
        self.scheduled_at: float | None = None
        self.queue_time_sent = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        for seq in self.sequences:  # a loop, not all() over a generator: read several times a step per request
            if seq.finish_reason is None:
                return False
        return True

    def num_generated_tokens(self) -> int:
        return sum(len(seq.token_ids) for seq in self.sequences)

    def steps_left(self, prefill_chunk_tokens: int) -> float:
        """The most steps this request may still run: its prompt's prefill chunks, then what is
        left of ``max_tokens`` (every choice decodes each step while the running rows fit the batch)."""
        if self.request.sampling.max_tokens is None:
            return float("inf")
        steps = 0.0
        for seq in self.unfinished():
            left = len(seq.prompt_token_ids) - min(seq.computed, len(seq.prompt_token_ids))
            prefill = -(-left // prefill_chunk_tokens) if left > 1 else 0
            steps = max(steps, prefill + self.request.sampling.max_tokens - len(seq.token_ids))
        return steps

    def unfinished(self) -> list[Sequence]:
        return [seq for seq in self.sequences if seq.finish_reason is None]

    def live_sequences(self) -> list[Sequence]:
        """The sequences the scheduler feeds: choice 0 alone until the children fork, then every
        unfinished choice."""
        return self.unfinished() if self.forked else self.sequences[:1]

    def make_output(self) -> RequestOutput | None:
        """What the last step changed — each changed choice's new ids and logprobs, and its finish
        once — or None when nothing did."""
        changed = []
        for i, seq in enumerate(self.sequences):
            if self._sent_finish[i]:
                continue
            sent, count = self._sent_tokens[i], len(seq.token_ids)
            if sent == count and seq.finish_reason is None:
                continue
            changed.append(self._delta(seq, sent))
            self._sent_tokens[i], self._sent_finish[i] = count, seq.finish_reason is not None
        return self._output(changed) if changed else None

    def abort(self) -> None:
        """Finish every running choice with ``"abort"``."""
        for seq in self.sequences:
            seq.finish("abort")

    def fail(self, error: EngineError) -> RequestOutput:
        """Finish every running choice with ``"abort"`` and return the in-band error item (every
        choice in full)."""
        self.abort()
        choices = [self._delta(seq, 0) for seq in self.sequences]
        self._sent_finish = [True] * len(self.sequences)
        return self._output(choices, error)

    @staticmethod
    def _delta(seq: Sequence, sent: int) -> CompletionOutput:
        return CompletionOutput(index=seq.index, text="", token_ids=seq.token_ids[sent:],
                                logprobs=None if seq.logprobs is None else seq.logprobs.since(sent),
                                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                                weight_versions=seq.versions_to_send())  # fmt: skip

    def _output(self, choices: list[CompletionOutput], error: EngineError | None = None) -> RequestOutput:
        return RequestOutput(request_id=self.request.request_id, outputs=choices, finished=self.finished,
                             # the request's own list, not a copy per output per step (readers copy what they keep)
                             prompt_token_ids=self.request.prompt_token_ids, prompt_logprobs=self.prompt_logprobs,
                             num_generated_tokens=self.num_generated_tokens(), error=error)  # fmt: skip
