"""A pipe that wakes a ZeroMQ poll loop from other threads, with the keys that became ready."""

from __future__ import annotations

import collections
import os
from typing import Any


class PollWakeup:
    """Threads call :meth:`notify` with a key; the loop polls :attr:`fd` and takes the keys with
    :meth:`take`. Many notifications before the loop runs cost one byte in the pipe."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._keys: collections.deque[Any] = collections.deque()
        self._signalled = False
        self._closed = False

    @property
    def fd(self) -> int:
        return self._read

    def notify(self, key: Any = None) -> None:
        if self._closed:  # the loop has ended (and the descriptor number may be another file's now)
            return
        self._keys.append(key)
        if not self._signalled:
            self._signalled = True
            try:
                os.write(self._write, b"x")
            except OSError:  # the pipe is full (the loop is already woken) or closed (the loop ended)
                pass

    def take(self) -> list[Any]:
        """Every key notified since the last call (the loop's thread)."""
        try:
            os.read(self._read, 4096)
        except OSError:
            pass
        # cleared before the keys are taken: a key added after this wakes the next poll
        self._signalled = False
        keys = []
        while self._keys:
            keys.append(self._keys.popleft())
        return keys

    def close(self) -> None:
        self._closed = True
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
