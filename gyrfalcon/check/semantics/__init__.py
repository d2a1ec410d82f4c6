"""The semantic checks, one module per endpoint group; importing this package registers them all
(in report order)."""

from __future__ import annotations

from collections.abc import Iterable

from gyrfalcon.check.registry import CHECKS, ENDPOINTS, Check
from gyrfalcon.check.semantics import models, texts, completions, chat, generate, batch, responses, errors  # noqa: F401


def selected(only: Iterable[str] | None = None) -> list[Check]:
    """Every semantic check, or those of the endpoint groups in ``only``."""
    wanted = set(ENDPOINTS if only is None else only)
    unknown = wanted - set(ENDPOINTS)
    if unknown:
        raise ValueError(f"unknown endpoint group(s) {sorted(unknown)}; choose from {', '.join(ENDPOINTS)}")
    return [c for c in CHECKS if c.endpoint in wanted]
