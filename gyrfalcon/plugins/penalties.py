"""The built-in penalty, bias, allow-list and bad-words processors of
:mod:`gyrfalcon.policies.penalties`, registered as a default plugin: block them
by this module's path (``--plugins-block gyrfalcon.plugins.penalties``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gyrfalcon.hookspecs import hookimpl
from gyrfalcon.policies import penalties

if TYPE_CHECKING:  # pragma: no cover
    from gyrfalcon.engine_api.types import EngineInfo
    from gyrfalcon.policies import LogitsProcessor


@hookimpl
def gyrfalcon_logits_processors(info: EngineInfo) -> list[LogitsProcessor]:
    return penalties.processors(info)
