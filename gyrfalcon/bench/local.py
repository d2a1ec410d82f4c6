"""An engine in the benchmark's own process, built as the server builds it (the composition root's
plugins, the settings given), for the harnesses that drive the engine without HTTP."""

from __future__ import annotations

import sys
from typing import Any


def ready_engine(settings: Any, path: str, timeout: float = 600.0) -> tuple[Any, Any] | None:
    """``(engine, plugin manager)`` once the engine serving ``path`` is ready; None, having said
    why on stderr, when it did not become ready."""
    from gyrfalcon.compose import plugins
    from gyrfalcon.plugins.engines import create_transformers_engine

    pm = plugins(settings)
    engine = create_transformers_engine(settings, pm, model_path=path)
    health = engine.wait_ready(timeout)
    if not health.ready:
        print(health.message, file=sys.stderr)
        engine.shutdown(grace=0.0)
        return None
    return engine, pm
