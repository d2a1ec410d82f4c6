"""The engine's control plane, the calls an RL trainer makes between rollouts: pause and resume
generation (:mod:`~gyrfalcon.engine.pause`), abort requests by the id of what a client sent, and
replace the weights (:mod:`~gyrfalcon.engine.weights`).

:class:`ControlPlane` is mixed into :class:`~gyrfalcon.engine.transformers_engine.TransformersEngine`
and works on what the engine holds: its lock and live requests, its pause gate (``_gate``) and
weight updates (``_weights``), its scheduler, runner and step loop, which calls
:meth:`ControlPlane._may_step` between two steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gyrfalcon.engine.weights import StagedWeights, served_tensors, stage
from gyrfalcon.heap import release_freed_memory
from gyrfalcon.engine_api.errors import ShuttingDown
from gyrfalcon.engine_api.types import PauseState

#: seconds an update of the weights waits for the step loop to take them (a step is milliseconds)
WEIGHTS_TIMEOUT_S = 120.0


class ControlPlane:
    """Pause, resume, abort by group, new weights (see the module docstring)."""

    _lock: Any
    _live: dict[str, Any]
    _gate: Any
    _weights: Any
    _health: Any
    _thread: Any
    scheduler: Any
    runner: Any
    engine_config: Any
    device: str
    quantization: str

    def abort_requests(self, group_ids: list[str] | None = None) -> int:
        with self._lock:
            ids = [i for i, s in self._live.items() if group_ids is None or s.request.group_id in group_ids]
        for request_id in ids:
            self.abort(request_id)
        return len(ids)

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> PauseState:
        with self._lock:
            self._gate.pause(mode, clear_cache)
            held = {id(s) for s in self._gate.held}
            cut = [i for i, s in self._live.items() if id(s) not in held] if mode == "abort" else []
        for request_id in cut:
            self.abort(request_id)
        self.scheduler.wake()
        return self.pause_state()

    def resume(self) -> PauseState:
        with self._lock:
            for state in self._gate.resume():
                self.scheduler.add(state, counted=True)
        self.scheduler.wake()
        return self.pause_state()

    def update_weights(self, model_path: str, weight_version: str | None = None) -> str:
        runner = self.runner
        if runner is None or not self._thread.is_alive():
            raise ShuttingDown(self._health.message or "the engine is not running")
        layers = runner.direct.layers if runner.direct is not None else []

        def staged(version: str) -> StagedWeights:
            return stage(served_tensors(runner.model, layers), model_path, version, self.engine_config, self.device,
                         self.quantization, layers)  # fmt: skip

        return self._weights.push(staged, weight_version, self.scheduler.wake, WEIGHTS_TIMEOUT_S)

    def pause_state(self) -> PauseState:
        with self._lock:
            return self._gate.state(len(self._live) - len(self._gate.held))

    def _may_step(self) -> bool:
        """Between two steps: new weights copied in (cached prefixes forgotten, and each running
        choice told from which token on they serve); False while a ``keep`` pause holds the loop
        still; a pause that asked for it clears the prefix cache once nothing runs."""
        staged = self._weights.take()
        if staged is not None:
            staged.apply()
            release_freed_memory()  # the staged copy, gone with the copy in: back to the process's level
            if self.scheduler.pool is not None:
                self.scheduler.pool.forget_prefixes()
            with self._lock:
                for seq in (seq for state in self._live.values() for seq in state.sequences):
                    seq.weights_replaced(staged.version)
            self._health = dataclasses.replace(self._health, weight_version=staged.version)
            self._weights.applied(staged.version)
        with self._lock:
            may = self._gate.may_step()
            clear = self._gate.clear_cache and len(self._live) == len(self._gate.held)
            self._gate.clear_cache &= not clear
        if clear and self.scheduler.pool is not None:
            self.scheduler.pool.forget_prefixes()
        return may
