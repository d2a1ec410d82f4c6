"""Admission: a bounded FIFO of waiting requests.

This first runner serves one request (all of its ``n`` choices) at a time; the continuous-batching
runner will replace :meth:`Scheduler.next_request` by a policy that merges newcomers between steps.
"""

from __future__ import annotations

import collections
import threading

from gyrfalcon.engine.outputs import RequestState
from gyrfalcon.errors import RequestError


class Scheduler:
    """Thread-safe bounded FIFO of :class:`RequestState` waiting to run."""

    def __init__(self, max_queue_len: int) -> None:
        self.max_queue_len = max_queue_len
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

    def next_request(self, timeout: float) -> RequestState | None:
        """The oldest waiting request, waiting up to ``timeout`` seconds for one."""
        with self._cond:
            if not self._waiting:
                self._cond.wait(timeout)
            return self._waiting.popleft() if self._waiting else None

    def drain(self) -> list[RequestState]:
        """Remove and return every waiting request."""
        with self._cond:
            states = list(self._waiting)
            self._waiting.clear()
            return states

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
