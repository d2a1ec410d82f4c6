"""Generation paused and resumed around a weight update, as RL trainers do (vLLM's ``/pause`` modes).

While paused, a request submitted is held here, not queued with the scheduler, until the resume;
held requests count against the queue's capacity. What was submitted before the pause is treated as
its mode says (``engine_api.types.PAUSE_MODES``): ``abort`` ends it at once, ``wait`` lets it run to
its end, ``keep`` stops the step loop so it stays where it is. The engine owns the gate and calls it
under its own lock; the step loop asks :meth:`PauseGate.may_step` between two steps.
"""

from __future__ import annotations

from typing import Any

from gyrfalcon.engine_api.errors import QueueFull
from gyrfalcon.engine_api.types import PAUSE_MODES, PauseState
from gyrfalcon.errors import RequestError


class PauseGate:
    """The pause's state: its mode, the requests held since, and what the step loop has seen."""

    def __init__(self) -> None:
        #: one of ``PAUSE_MODES``; None: generation runs
        self.mode: str | None = None
        #: requests submitted while paused (engine request states), in order
        self.held: list[Any] = []
        #: the step loop has seen a ``keep`` pause and takes no step
        self.frozen = False
        #: the prefix cache is to forget every block once nothing runs
        self.clear_cache = False

    def pause(self, mode: str, clear_cache: bool) -> None:
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode")
        self.mode = mode
        self.clear_cache = clear_cache and mode != "keep"

    def hold(self, state: Any, room: int) -> bool:
        """Hold ``state`` when paused (``room``: places left in the queue); False when not paused."""
        if self.mode is None:
            return False
        if room <= 0:
            raise QueueFull("the server is paused and its queue is full")
        self.held.append(state)
        return True

    def release(self, request_id: str) -> Any | None:
        """The held request of ``request_id``, no longer held (None when it is not held)."""
        for i, state in enumerate(self.held):
            if state.request_id == request_id:
                return self.held.pop(i)
        return None

    def resume(self) -> list[Any]:
        """Generation runs again: the held requests, in the order they came."""
        held, self.held = self.held, []
        self.mode, self.frozen, self.clear_cache = None, False, False
        return held

    def may_step(self) -> bool:
        """Between two steps (the step loop): False while a ``keep`` pause holds the loop still."""
        self.frozen = self.mode == "keep"
        return not self.frozen

    def state(self, running: int) -> PauseState:
        """The pause as :class:`PauseState` says it (``running``: live requests not held)."""
        if self.mode is None:
            return PauseState()
        settled = self.frozen if self.mode == "keep" else running == 0 and not self.clear_cache
        return PauseState(self.mode, settled, len(self.held))
