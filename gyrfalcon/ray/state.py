"""What the control calls made the engine replicas serve beyond their settings, kept apart from them.

A control call (``update_weights``, a LoRA adapter's load or unload) is broadcast to the engine
replicas that run when it is made. One Ray starts later — autoscaled, replacing one that died, even
the only one — would serve its settings' weights and adapters. So the ingress records here each
call every replica applied (:class:`~gyrfalcon.ray.core.RayEngineCore`), and an engine replica,
once its model is loaded, takes over what is recorded before it takes a request
(:mod:`gyrfalcon.ray.replica`).

A pause is recorded too (its mode, until a resume): a queue that builds while generation is paused
is what makes Ray add a replica, which must not serve the queue before the resume. Sleep is not
recorded (CPU engines only, and a new replica holds its memory until it is asked to sleep).

One replica, no CPU, holding a few strings: no request ever queues behind a generate call to reach
it. Its argument is the application's settings, so redeploying the application with other settings
starts it anew. Its record lives in its memory: should its replica die, Ray starts it again empty,
and replicas started after that serve their settings' weights until the next call (the running ones
keep what they serve).
"""

from __future__ import annotations

from typing import Any


class ServedState:
    """The weights pushed last, the adapters loaded or unloaded at run time in the order of the
    calls, and the pause."""

    def __init__(self, settings_json: str) -> None:
        del settings_json  # (only in the deployment's arguments: other settings, a new replica)
        self._weights: list[str] | None = None
        #: each adapter a call named: its folder, or None once unloaded
        self._adapters: dict[str, str | None] = {}
        self._paused: str | None = None

    def get(self) -> dict[str, Any]:
        """``{"weights": [path, version] or None, "adapters": [[name, path or None], …], "paused": mode or None}``."""
        return {"weights": self._weights, "adapters": [[name, path] for name, path in self._adapters.items()],
                "paused": self._paused}  # fmt: skip

    def weights(self, path: str, version: str | None) -> None:
        """Weights pushed from ``path`` as ``version``."""
        self._weights = [path, version]

    def paused(self, mode: str | None) -> None:
        """Generation paused in ``mode`` (None: resumed)."""
        self._paused = mode

    def adapter(self, name: str, path: str | None) -> None:
        """The adapter ``name`` loaded from ``path``, or unloaded (None)."""
        self._adapters[name] = path

