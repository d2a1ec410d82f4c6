"""The built-in tool-call parsers: ``hermes`` (``<tool_call>{json}</tool_call>``) and ``json`` (bare JSON)."""

from __future__ import annotations

from typing import Any

from gyrfalcon.hookspecs import hookimpl


@hookimpl
def gyrfalcon_tool_parsers() -> dict[str, Any]:
    """Offer the built-in conventions (see :mod:`gyrfalcon.tools.parsers`)."""
    from gyrfalcon.tools.parsers import BUILTIN_PARSERS

    return dict(BUILTIN_PARSERS)
