"""Per-request output aggregation: turns the choices' progress into ``RequestOutput`` items.

- DELTA: only choices that changed, only what is new; every choice's last item carries its
  ``finish_reason`` even when it brings no new token.
- CUMULATIVE: every choice, everything so far, at each step that changed something.
- FINAL_ONLY: one item when all ``n`` choices have finished, choices indexed ``0..n-1`` in order.

Text that could still turn into a stop string is held back until it cannot (DELTA, CUMULATIVE).
"""

from __future__ import annotations

from dataclasses import dataclass

from gyrfalcon.engine_api.interface import OutputStream
from gyrfalcon.engine.sequence import Sequence
from gyrfalcon.engine_api.types import CompletionOutput, EngineError, EngineRequest, OutputKind, RequestOutput, TokenLogprobs


def _slice_logprobs(logprobs: TokenLogprobs | None, start: int) -> TokenLogprobs | None:
    if logprobs is None:
        return None
    return TokenLogprobs(
        list(logprobs.token_ids[start:]),
        list(logprobs.logprobs[start:]),
        [list(x) for x in logprobs.top_token_ids[start:]],
        [list(x) for x in logprobs.top_logprobs[start:]],
    )


@dataclass
class _Sent:
    """How much of one choice has been sent."""

    chars: int = 0
    tokens: int = 0
    finished: bool = False


class RequestState:
    """A request inside the engine: its choices (``sequences``), its stream and what was sent."""

    def __init__(self, request: EngineRequest, stream: OutputStream, sequences: list[Sequence]) -> None:
        self.request = request
        self.stream = stream
        self.sequences = sequences
        self.kind = OutputKind(request.output_kind)
        self._sent = [_Sent() for _ in sequences]
        self.abort_requested = False
        self.closed = False
        #: the prompt's logprobs, when asked for (gathered chunk by chunk while the prompt is prefilled)
        self.prompt_logprobs: TokenLogprobs | None = None
        #: prompt positions whose logprobs are gathered (the next chunk starts here)
        self.prompt_logprobs_done = 0
        #: True once the ``n`` children run on their own (after the first token); before, only
        #: choice 0 is scheduled: the prompt is prefilled once for all of them
        self.forked = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)

    def unfinished(self) -> list[Sequence]:
        return [seq for seq in self.sequences if not seq.finished]

    def live_sequences(self) -> list[Sequence]:
        """The sequences the scheduler feeds: choice 0 alone until the children fork, then every
        unfinished choice."""
        return self.unfinished() if self.forked else self.sequences[:1]

    def num_generated_tokens(self) -> int:
        return sum(len(seq.token_ids) for seq in self.sequences)

    def _output(self, choices: list[CompletionOutput], error: EngineError | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            outputs=choices,
            finished=self.finished,
            prompt_token_ids=list(self.request.prompt_token_ids),
            prompt_logprobs=self.prompt_logprobs,
            num_generated_tokens=self.num_generated_tokens(),
            error=error,
        )

    def _full(self, seq: Sequence) -> CompletionOutput:
        text = seq.visible_text()
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=list(seq.token_ids),
            logprobs=_slice_logprobs(seq.logprobs, 0),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def make_output(self) -> RequestOutput | None:
        """The next item for the stream after a step, or None when there is nothing to send."""
        if self.kind is OutputKind.FINAL_ONLY:
            if not self.finished or all(s.finished for s in self._sent):
                return None
            for sent in self._sent:
                sent.finished = True
            return self._output([self._full(seq) for seq in self.sequences])

        changed: list[CompletionOutput] = []
        for seq, sent in zip(self.sequences, self._sent):
            if sent.finished:
                continue
            text = seq.visible_text()
            new_text = text[sent.chars :]
            new_tokens = seq.token_ids[sent.tokens :]
            if not new_text and not new_tokens and not seq.finished:
                continue
            if self.kind is OutputKind.DELTA:
                choice = CompletionOutput(
                    index=seq.index,
                    text=new_text,
                    token_ids=list(new_tokens),
                    logprobs=_slice_logprobs(seq.logprobs, sent.tokens),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            else:
                choice = self._full(seq)
            sent.chars = max(sent.chars, len(text))
            sent.tokens = len(seq.token_ids)
            sent.finished = seq.finished
            changed.append(choice)
        if not changed:
            return None
        if self.kind is OutputKind.CUMULATIVE:
            changed = [self._full(seq) for seq in self.sequences]
        return self._output(changed)

    def abort(self) -> None:
        """Finish every running choice with ``"abort"``."""
        for seq in self.sequences:
            seq.finish("abort")

    def fail(self, error: EngineError) -> RequestOutput:
        """Finish every running choice with ``"abort"`` and return the in-band error item."""
        self.abort()
        for sent in self._sent:
            sent.finished = True
        return self._output([self._full(seq) for seq in self.sequences], error=error)
