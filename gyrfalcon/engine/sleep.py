"""Sleep between rollout phases: the engine's memory handed back to the system, and taken again
(vLLM's ``/sleep`` levels and ``/wake_up`` tags, ``engine_api.types.SLEEP_LEVELS``).

Level 1 hands back the KV cache's memory, level 2 the served weights' too. The pages go back in
place (``madvise(MADV_DONTNEED)`` over each tensor's whole pages): the tensors keep their
addresses, so the decode path's native layer loop, compiled step and every view of a weight still
point at them, and nothing is rebuilt on waking. Waking refills them: the KV cache is zeroed (what
it held was forgotten with the prefix cache, and zeroing takes its memory up front again, as at
start-up), the weights are loaded again from where they last came from and copied in, as an update
does (:mod:`~gyrfalcon.engine.weights`; an update while asleep refills them too).

Handing pages back in place needs anonymous CPU memory and Linux's ``madvise``: on another device
or system a sleep is refused (:func:`unsupported`). The step loop owns the memory: it hands it back
between two steps once nothing runs, and takes no step while any part sleeps.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Iterable

import torch

from gyrfalcon.engine_api.types import SLEEP_LEVELS, WAKE_TAGS, SleepState
from gyrfalcon.errors import RequestError

_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
except (OSError, AttributeError):  # no C library to ask: sleep is refused
    _madvise = None


def unsupported(device: str) -> str | None:
    """Why an engine on ``device`` cannot sleep here (None: it can)."""
    if not device.startswith("cpu"):
        return f"sleep hands memory back on CPU engines only; this one runs on {device}"
    if _madvise is None or _MADV_DONTNEED is None:
        return "sleep needs madvise(MADV_DONTNEED), which this system does not offer"
    return None


def hand_back(tensors: Iterable[torch.Tensor]) -> int:
    """Hand the whole pages of each tensor's memory back to the system (their contents become
    zeros at the next touch); the bytes handed back. Views of one storage count once."""
    spans = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors if t.numel()}
    page, total = mmap.PAGESIZE, 0
    for start, size in sorted(spans):
        first, end = -(-start // page) * page, (start + size) // page * page
        if end > first:
            if _madvise(first, end - first, _MADV_DONTNEED) != 0:
                raise OSError(ctypes.get_errno(), f"madvise: {os.strerror(ctypes.get_errno())}")
            total += end - first
    return total


def wake_tags(tags: list[str] | None) -> tuple[str, ...]:
    """``/wake_up``'s ``tags`` as a tuple of :data:`WAKE_TAGS` (none given: every part)."""
    if not tags:
        return WAKE_TAGS
    unknown = [t for t in tags if t not in WAKE_TAGS]
    if unknown:
        raise RequestError(f"tags must be among {', '.join(WAKE_TAGS)}, got {unknown[0]!r}", "tags")
    return tuple(t for t in WAKE_TAGS if t in tags)


class Sleep:
    """The sleep's state: what a sleep asked for, what is handed back now, and whether the sleep
    made the pause that holds new requests (then waking all parts ends it). Its lock is held
    while memory changes hands (the step loop hands back, a wake takes back)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: the level the last sleep asked for (0: awake)
        self.level = 0
        #: parts to hand back once nothing runs
        self.due: set[str] = set()
        #: parts handed back now
        self.asleep: set[str] = set()
        #: the sleep paused generation (it was running): waking every part resumes it
        self.owns_pause = False

    def ask(self, level: int) -> None:
        """A sleep of ``level`` (checked): its parts handed back once nothing runs."""
        if level not in SLEEP_LEVELS:
            raise RequestError(f"level must be one of {', '.join(map(str, SLEEP_LEVELS))}, got {level}", "level")
        self.level = max(self.level, level)
        self.due |= set(SLEEP_LEVELS[level]) - self.asleep

    def woken(self, tags: tuple[str, ...]) -> bool:
        """``tags`` are back (a sleep still due for them is called off); True once every part is."""
        self.due -= set(tags)
        self.asleep -= set(tags)
        if not self.due and not self.asleep:
            self.level = 0
            return True
        return False

    def state(self) -> SleepState:
        return SleepState(self.level, tuple(t for t in WAKE_TAGS if t in self.asleep), not self.due)
