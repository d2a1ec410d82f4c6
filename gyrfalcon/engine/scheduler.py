"""Admission: a bounded FIFO of waiting requests and the policy that moves them into the batch.

Between decode steps the step loop asks :meth:`Scheduler.admit` for the next group to prefill. A
group is the oldest waiting request plus any other waiting requests with the same prompt length
(prefilled together in one forward: equal lengths, so no padding inside the forward), as long as

- the running sequences plus the group's ``n`` children stay within ``max_num_seqs``;
- the padded batch after the merge, ``rows × longest``, stays within ``max_num_batched_tokens``
  (an empty batch always takes the oldest request, whatever its size, so nothing starves);
- the group's prompt tokens stay within one prefill chunk (a longer prompt is prefilled alone,
  chunk by chunk, with decode steps of the running batch in between).

The oldest request is never overtaken by a request that does not share its prompt length.
"""

from __future__ import annotations

import collections
import threading

from gyrfalcon.engine.outputs import RequestState
from gyrfalcon.errors import RequestError


class Scheduler:
    """Thread-safe bounded FIFO of :class:`RequestState` waiting to run, with the admission policy."""

    def __init__(
        self,
        max_queue_len: int,
        max_num_seqs: int = 1,
        max_num_batched_tokens: int = 1 << 30,
        prefill_chunk_tokens: int = 512,
    ) -> None:
        self.max_queue_len = max_queue_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._waiting: collections.deque[RequestState] = collections.deque()
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, state: RequestState) -> None:
        """Enqueue, or raise a 503 ``RequestError`` (with ``Retry-After``) when the queue is full."""
        with self._cond:
            if len(self._waiting) >= self.max_queue_len:
                raise RequestError(
                    f"the server is busy: {self.max_queue_len} requests are already waiting",
                    None,
                    status=503,
                    type="server_overloaded",
                    headers={"Retry-After": "1"},
                )
            self._waiting.append(state)
            self._cond.notify()

    def remove(self, request_id: str) -> RequestState | None:
        """Take a waiting request out of the queue (None when it is not waiting)."""
        with self._cond:
            for state in self._waiting:
                if state.request_id == request_id:
                    self._waiting.remove(state)
                    return state
        return None

    def admit(self, running_rows: int, running_width: int) -> list[RequestState]:
        """Remove and return the next group to prefill (empty when nothing may start now).

        ``running_rows``/``running_width``: the running batch's sequences and cache width.
        """
        with self._cond:
            if not self._waiting:
                return []
            head = self._waiting[0]
            length = len(head.request.prompt_token_ids)
            rows = running_rows
            group: list[RequestState] = []
            for state in list(self._waiting):
                if len(state.request.prompt_token_ids) != length:
                    continue
                children = len(state.sequences)
                padded = (rows + children) * max(running_width, length)
                fits = rows + children <= self.max_num_seqs and padded <= self.max_num_batched_tokens
                chunk_ok = (len(group) + 1) * length <= self.prefill_chunk_tokens
                if group and not (fits and chunk_ok):
                    break
                if not group and not (fits or running_rows == 0):
                    return []  # the oldest waits for rows or tokens to free up
                group.append(state)
                rows += children
            for state in group:
                self._waiting.remove(state)
            return group

    def wait(self, timeout: float) -> None:
        """Block until a request arrives (or :meth:`wake`, or ``timeout`` seconds)."""
        with self._cond:
            if not self._waiting:
                self._cond.wait(timeout)

    def drain(self) -> list[RequestState]:
        """Remove and return every waiting request."""
        with self._cond:
            states = list(self._waiting)
            self._waiting.clear()
            return states

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
