"""A request inside the engine core: its choices' sequences, its stream and its scheduling state."""

from __future__ import annotations

import time

from gyrfalcon.engine.sequence import Sequence
from gyrfalcon.engine_api.interface import OutputStream
from gyrfalcon.engine_api.outputs import OutputAggregator
from gyrfalcon.engine_api.types import EngineRequest, OutputKind


class RequestState(OutputAggregator):
    """The core's side of a request; it reports token ids to the client as DELTA outputs."""

    def __init__(self, request: EngineRequest, stream: OutputStream, sequences: list[Sequence]) -> None:
        super().__init__(request, sequences, OutputKind.DELTA)
        self.stream = stream
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

    def unfinished(self) -> list[Sequence]:
        return [seq for seq in self.sequences if not seq.finished]

    def live_sequences(self) -> list[Sequence]:
        """The sequences the scheduler feeds: choice 0 alone until the children fork, then every
        unfinished choice."""
        return self.unfinished() if self.forked else self.sequences[:1]
