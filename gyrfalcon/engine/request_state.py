"""A request inside the engine core: its choices' sequences, its stream and its scheduling state.

The core speaks token ids: after each step a request reports, for every choice that changed, the
ids and logprobs it gained since its last report, and a choice's finish once (DELTA outputs, no
text). The client turns them into text in the request's own output kind
(:class:`~gyrfalcon.client.aggregator.OutputAggregator`).
"""

from __future__ import annotations

import time

from gyrfalcon.engine.sequence import Sequence
from gyrfalcon.engine_api.interface import OutputStream
from gyrfalcon.engine_api.types import CompletionOutput, EngineError, EngineRequest, RequestOutput, TokenLogprobs


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
