"""The built-in logprob gatherers of :mod:`gyrfalcon.policies.logprobs`, registered as a default plugin: block them
by this module's path (``--plugins-block gyrfalcon.plugins.logprobs``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gyrfalcon.hookspecs import hookimpl
from gyrfalcon.policies import logprobs

if TYPE_CHECKING:  # pragma: no cover
    from gyrfalcon.engine_api.types import EngineInfo
    from gyrfalcon.policies import LogprobGatherer


@hookimpl
def gyrfalcon_logprob_gatherers(info: EngineInfo) -> list[LogprobGatherer]:
    return logprobs.gatherers(info)
