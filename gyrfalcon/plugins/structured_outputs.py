"""The built-in structured-output plugin (llguidance): ``response_format`` and ``structured_outputs``.

Registered like any third-party plugin: a frontend hook checks a constraint's syntax before any
status (a bad schema, regex or grammar is a 400 naming its field), and an engine hook offers the
processor that masks each constrained row to what its grammar allows next.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gyrfalcon.hookspecs import hookimpl

if TYPE_CHECKING:  # pragma: no cover
    from gyrfalcon.engine_api.types import EngineInfo, EngineRequest


@hookimpl
def gyrfalcon_validate_request(endpoint: str, request: EngineRequest, info: EngineInfo) -> None:
    """A constraint whose grammar does not compile is a 400 (its grammar is cached for the engine)."""
    constraint = request.sampling.structured_outputs
    if constraint is not None and "structured_outputs" in info.capabilities:
        from gyrfalcon.structured.grammar import check

        check(constraint)


@hookimpl
def gyrfalcon_logits_processors(info: EngineInfo) -> list[Any]:
    """The structured-output processor (torch and llguidance are imported in the engine only)."""
    from gyrfalcon.structured.processor import StructuredOutputProcessor

    return [StructuredOutputProcessor(info)]
