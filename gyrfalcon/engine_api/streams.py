"""An output stream that never grows without bound: a lagging reader gets coalesced deltas.

The step loop puts one item per step per request; a consumer that reads slower than that (a slow
client, a busy serving thread) would otherwise let the queue grow for as long as the request runs.
Here an item put while the previous one is still unread is merged into it:

- DELTA: per choice, text and token ids are concatenated, logprobs extended, the later finish and
  stop reasons win — the reader sees exactly the same totals, in fewer, larger deltas;
- CUMULATIVE: the newer item replaces the unread one (it already contains everything);
- FINAL_ONLY: there is only one item anyway.

Items carrying an error, and the end marker, are never merged, so at most two items wait at once.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any

from gyrfalcon.engine_api.interface import OutputStream
from gyrfalcon.engine_api.types import CompletionOutput, OutputKind, RequestOutput


def merge_deltas(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    """One DELTA output equivalent to ``first`` followed by ``second`` (``first`` is reused)."""
    choices: dict[int, CompletionOutput] = {c.index: c for c in first.outputs}
    for choice in second.outputs:
        earlier = choices.get(choice.index)
        if earlier is None:
            choices[choice.index] = choice
            continue
        earlier.text += choice.text
        earlier.token_ids = [*earlier.token_ids, *choice.token_ids]
        if choice.logprobs is not None:
            if earlier.logprobs is None:
                earlier.logprobs = choice.logprobs
            else:
                earlier.logprobs.extend(choice.logprobs)
        earlier.finish_reason = choice.finish_reason
        earlier.stop_reason = choice.stop_reason
    second.outputs = sorted(choices.values(), key=lambda c: c.index)
    if second.prompt_logprobs is None:
        second.prompt_logprobs = first.prompt_logprobs
    if second.queue_time is None:
        second.queue_time = first.queue_time
    return second


class CoalescingOutputStream(OutputStream):
    """An :class:`OutputStream` whose unread items are merged (see the module docstring)."""

    def __init__(self, request_id: str, kind: OutputKind, on_close: Any = None) -> None:
        super().__init__(request_id, on_close)
        self.kind = OutputKind(kind)
        self._items: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        #: how many items were merged into an unread one (a measure of reader lag)
        self.coalesced = 0

    def pending(self) -> int:
        """Items put and not yet read (at most 2)."""
        return len(self._items)

    def put(self, output: RequestOutput) -> None:
        with self._cond:
            last = self._items[-1] if self._items else None
            mergeable = (
                isinstance(last, RequestOutput)
                and last.error is None
                and output.error is None
                and self.kind is not OutputKind.FINAL_ONLY
            )
            if mergeable:
                self._items[-1] = merge_deltas(last, output) if self.kind is OutputKind.DELTA else output
                self.coalesced += 1
            else:
                self._items.append(output)
            self._cond.notify()
        self._wake()

    def finish(self) -> None:
        with self._cond:
            self._items.append(self._END)
            self._cond.notify()
        self._wake()

    def _take(self, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._items:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise queue.Empty
                self._cond.wait(remaining)
            return self._items.popleft()
