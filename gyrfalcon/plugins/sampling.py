"""The built-in sampling processors (temperature, min_p, top_k, top_p of
:mod:`gyrfalcon.policies.sampling`), registered as a default plugin: block them
by this module's path (``--plugins-block gyrfalcon.plugins.sampling``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gyrfalcon.hookspecs import hookimpl
from gyrfalcon.policies import sampling

if TYPE_CHECKING:  # pragma: no cover
    from gyrfalcon.engine_api.types import EngineInfo
    from gyrfalcon.policies import LogitsProcessor


@hookimpl
def gyrfalcon_logits_processors(info: EngineInfo) -> list[LogitsProcessor]:
    return sampling.processors(info)
