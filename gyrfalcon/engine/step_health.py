"""Steps that keep failing, as health sees them.

A step that fails for the server's sake (an in-band error of a kind that is not the request's
doing, or the step loop's own exception) and computes nothing adds to a count of failures in a row;
a step that computes tokens ends it. From :data:`FAILED_STEPS_UNHEALTHY` failures on, health reports
the engine unhealthy with the last reason (``/health`` answers 503, so a balancer or supervisor sees
it), until a step computes again or :data:`PROBATION_S` pass without another failure (an idle
engine runs no step that could succeed).
"""

from __future__ import annotations

import time

from gyrfalcon.engine_api.types import EngineHealth

FAILED_STEPS_UNHEALTHY = 3
PROBATION_S = 30.0
#: in-band error kinds that are the request's doing (or a retry's matter), not a failure of the server
CLIENT_ERROR_TYPES = frozenset({"invalid_request_error", "server_shutting_down", "server_overloaded"})


class StepFailures:
    """The engine's count of steps failed in a row (engine thread writes, any thread reads)."""

    def __init__(self) -> None:
        self._failing: tuple[int, float, str] | None = None  # (in a row, when the last failed, why)
        self._in_step: str | None = None  # the last server failure of the step running now

    def step_started(self) -> None:
        self._in_step = None

    def request_failed(self, kind: str, message: str) -> None:
        """A request of the running step ended with an error of ``kind``."""
        if kind not in CLIENT_ERROR_TYPES:
            self._in_step = message

    def step_ended(self, computed: bool, failure: str | None = None) -> None:
        """After a step (``computed``: it computed tokens); ``failure``: the loop's own exception."""
        failure = failure or self._in_step
        if failure is not None and not computed:
            count = self._failing[0] + 1 if self._failing is not None else 1
            self._failing = (count, time.monotonic(), failure[:300])
        elif computed:
            self._failing = None

    def health(self, health: EngineHealth) -> EngineHealth:
        """``health``, or unhealthy with the reason while steps keep failing."""
        failing = self._failing
        if (health.ready and failing is not None and failing[0] >= FAILED_STEPS_UNHEALTHY
                and time.monotonic() - failing[1] < PROBATION_S):  # fmt: skip
            return EngineHealth(ready=False, message=f"the last {failing[0]} steps failed: {failing[2]}",
                                decode_path=health.decode_path)  # fmt: skip
        return health
