"""The client's output aggregation: turns its choices' text progress into ``RequestOutput`` items
in the request's own output kind.

- DELTA: only choices that changed, only what is new; every choice's last item carries its
  ``finish_reason`` even when it brings no new token.
- CUMULATIVE: every choice, everything so far, at each step that changed something.
- FINAL_ONLY: one item when all ``n`` choices have finished, choices indexed ``0..n-1`` in order.

Text that could still turn into a stop string is held back until it cannot (DELTA, CUMULATIVE).
The engine core reports token-id deltas of its own
(:meth:`~gyrfalcon.engine.request_state.RequestState.make_output`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from gyrfalcon.engine_api.types import CompletionOutput, EngineError, EngineRequest, OutputKind, RequestOutput, TokenLogprobs


class Choice(Protocol):
    """What aggregation reads of a choice (the core's sequences and the client's choices alike)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: TokenLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None
    weight_versions: list[list[Any]] | None

    @property
    def finished(self) -> bool: ...

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None: ...

    def visible_text(self) -> str: ...


@dataclass
class _Sent:
    """How much of one choice has been sent."""

    chars: int = 0
    tokens: int = 0
    finished: bool = False


class OutputAggregator:
    """A request's choices (``sequences``) and what of them was sent, in ``kind``."""

    def __init__(self, request: EngineRequest, sequences: list, kind: OutputKind | None = None) -> None:
        self.request = request
        self.sequences = sequences
        self.kind = OutputKind(kind if kind is not None else request.output_kind)
        self._sent = [_Sent() for _ in sequences]
        #: the prompt's logprobs, when asked for
        self.prompt_logprobs: TokenLogprobs | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)

    def num_generated_tokens(self) -> int:
        return sum(len(seq.token_ids) for seq in self.sequences)

    def _output(self, choices: list[CompletionOutput], error: EngineError | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            outputs=choices,
            finished=self.finished,
            # the request's own list, not a copy per output per step (readers copy what they keep)
            prompt_token_ids=self.request.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            num_generated_tokens=self.num_generated_tokens(),
            error=error,
        )

    def _full(self, seq: Choice) -> CompletionOutput:
        text = seq.visible_text()
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=list(seq.token_ids),
            logprobs=None if seq.logprobs is None else seq.logprobs.since(0),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            weight_versions=seq.weight_versions if seq.finished else None,
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
                    logprobs=None if seq.logprobs is None else seq.logprobs.since(sent.tokens),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    weight_versions=seq.weight_versions if seq.finished else None,
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
