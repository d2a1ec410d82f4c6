"""A choice's progress — token ids, logprobs, finish — as both sides of the engine boundary keep
it: the core's :class:`~gyrfalcon.engine.request_state.Sequence` and the client's
:class:`~gyrfalcon.client.choice.ChoiceText`. What each side makes of it differs: the core reports
token-id deltas (:class:`~gyrfalcon.engine.request_state.RequestState`), the client text in the
request's output kind (:class:`~gyrfalcon.client.aggregator.OutputAggregator`).
"""

from __future__ import annotations

from gyrfalcon.engine_api.types import TokenLogprobs


class ChoiceProgress:
    """A choice's tokens, logprobs and finish, as both the core's sequences and the client's
    choices keep them (the first finish wins)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: TokenLogprobs | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.stop_reason = stop_reason

    def add_logprobs(self, logprobs: TokenLogprobs) -> None:
        if self.logprobs is None:
            self.logprobs = TokenLogprobs()
        self.logprobs.extend(logprobs)
