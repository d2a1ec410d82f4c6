"""The engine's control plane, the calls an RL trainer makes between rollouts: pause and resume
generation (:mod:`~gyrfalcon.engine.pause`), abort requests by the id of what a client sent,
replace the weights (:mod:`~gyrfalcon.engine.weights`), and sleep and wake up
(:mod:`~gyrfalcon.engine.sleep`).

:class:`ControlPlane` is mixed into :class:`~gyrfalcon.engine.transformers_engine.TransformersEngine`
and works on what the engine holds: its lock and live requests, its pause gate (``_gate``),
weight updates (``_weights``) and sleep (``_sleep``), its scheduler, runner and step loop, which
calls :meth:`ControlPlane._may_step` between two steps.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from gyrfalcon.engine import sleep as sleeping
from gyrfalcon.engine.weights import StagedWeights, served_tensors, stage
from gyrfalcon.errors import RequestError
from gyrfalcon.heap import trim_heap
from gyrfalcon.engine_api.errors import ShuttingDown
from gyrfalcon.engine_api.types import PauseState, SleepState

log = logging.getLogger(__name__)

#: seconds an update of the weights waits for the step loop to take them (a step is milliseconds)
WEIGHTS_TIMEOUT_S = 120.0


class ControlPlane:
    """Pause, resume, abort by group, new weights (see the module docstring)."""

    _lock: Any
    _live: dict[str, Any]
    _gate: Any
    _weights: Any
    _sleep: Any
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
            self._sleep.owns_pause = False  # the pause is the caller's now: waking leaves it
            held = {id(s) for s in self._gate.held}
            cut = [i for i, s in self._live.items() if id(s) not in held] if mode == "abort" else []
        for request_id in cut:
            self.abort(request_id)
        self.scheduler.wake()
        return self.pause_state()

    def resume(self) -> PauseState:
        with self._lock:
            if self._sleep.asleep or self._sleep.due:
                raise RequestError("the engine sleeps (or is falling asleep): wake it up first (POST /wake_up)", None)
            self._resume()
        self.scheduler.wake()
        return self.pause_state()

    def _resume(self) -> None:
        """Under the lock: generation runs again, what the pause held queued in order."""
        for state in self._gate.resume():
            self.scheduler.add(state, counted=True)
        self._sleep.owns_pause = False

    def update_weights(self, model_path: str, weight_version: str | None = None, flush_cache: bool = True) -> str:
        def staged(version: str) -> StagedWeights:
            return dataclasses.replace(self._stage(model_path, version), flush_cache=flush_cache)

        return self._weights.push(staged, weight_version, self.scheduler.wake, WEIGHTS_TIMEOUT_S)

    def _stage(self, path: str, version: str) -> StagedWeights:
        runner = self.runner
        if runner is None or not self._thread.is_alive():
            raise ShuttingDown(self._health.message or "the engine is not running")
        layers = runner.direct.layers if runner.direct is not None else []
        return stage(runner.model, layers, path, version, self.engine_config, self.device, self.quantization)

    def sleep(self, level: int = 1) -> SleepState:
        why = sleeping.unsupported(self.device)
        if why is not None:
            raise RequestError(why, "level")
        with self._lock:
            running = len(self._live) - len(self._gate.held)
            if self._gate.mode == "keep" and running:
                raise RequestError(f"a keep pause holds {running} running request(s) whose KV cache a sleep would "
                                   "hand back: resume them, or pause with mode=abort or wait first", "level")  # fmt: skip
            self._sleep.ask(level)
            if self._gate.mode is None:  # new requests wait for the wake; what runs ends first
                self._gate.pause("wait", True)
                self._sleep.owns_pause = True
        self.scheduler.wake()
        return self.sleep_state()

    def wake_up(self, tags: list[str] | None = None) -> SleepState:
        parts = sleeping.wake_tags(tags)
        with self._sleep.lock, self._lock:
            self._sleep.due -= set(parts)  # a sleep still waiting for what runs hands none of them back now
        if "weights" in parts and "weights" in self._sleep.asleep:
            self._weights.reload(self._stage, self.scheduler.wake, WEIGHTS_TIMEOUT_S)  # the loop marks them back
        with self._sleep.lock:
            if "kv_cache" in parts and "kv_cache" in self._sleep.asleep:
                for tensor in (*self.runner.cache.keys, *self.runner.cache.values):
                    tensor.zero_()  # the pages taken again, as at start-up
            with self._lock:
                if self._sleep.woken(parts) and self._sleep.owns_pause:
                    self._resume()
        self.scheduler.wake()
        return self.sleep_state()

    def sleep_state(self) -> SleepState:
        with self._lock:
            return self._sleep.state()

    def pause_state(self) -> PauseState:
        with self._lock:
            return self._gate.state(len(self._live) - len(self._gate.held))

    def _may_step(self) -> bool:
        """Between two steps: new weights copied in (a new epoch of the prefix cache's keys, and each running
        choice told from which token on they serve); False while a ``keep`` pause holds the loop
        still; a pause that asked for it clears the prefix cache once nothing runs."""
        staged = self._weights.take()
        if staged is not None:
            with self._sleep.lock:
                staged.apply()
                self._sleep.asleep.discard("weights")  # every served tensor written again
            trim_heap()  # the staged copy, gone with the copy in (no cycle holds it): back to the process's level
            self.scheduler.weights_replaced()  # cached prefixes are keyed by the weights' epoch
            if staged.flush_cache and self.scheduler.pool is not None:
                self.scheduler.pool.forget_prefixes()
            with self._lock:
                for seq in (seq for state in self._live.values() for seq in state.sequences):
                    seq.weights_replaced(staged.version)
            self._health = dataclasses.replace(self._health, weight_version=staged.version)
            self._weights.applied(staged)
        with self._lock:
            may = self._gate.may_step()
            quiet = len(self._live) == len(self._gate.held)
            clear = self._gate.clear_cache and quiet
            self._gate.clear_cache &= not clear
        if clear and self.scheduler.pool is not None:
            self.scheduler.pool.forget_prefixes()
        if self._sleep.due and quiet:
            self._fall_asleep()
        return may and not self._sleep.asleep

    def _fall_asleep(self) -> None:
        """Between two steps, nothing running: hand back the memory of the parts a sleep asked for."""
        runner = self.runner
        with self._sleep.lock:
            parts = set(self._sleep.due)
            tensors = []
            if "kv_cache" in parts:
                tensors += [*runner.cache.keys, *runner.cache.values]
            if "weights" in parts:
                layers = runner.direct.layers if runner.direct is not None else []
                tensors += list(served_tensors(runner.model, layers).values())
            if self.scheduler.pool is not None:
                self.scheduler.pool.forget_prefixes()  # what the cached blocks held is gone
            handed = sleeping.hand_back(tensors)
            with self._lock:
                self._sleep.asleep |= parts
                self._sleep.due -= parts
        trim_heap()
        log.warning("asleep (%s): %.0f MiB handed back", ", ".join(sorted(parts)), handed / 2**20)
