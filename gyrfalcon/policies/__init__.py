"""The batch-shaped engine policies: their base classes (:mod:`.base`), the bounds they read
(:mod:`.bounds`), and the built-in ones the sampler runs — sampling (:mod:`.sampling`), penalties,
bias, allow-lists and bad words (:mod:`.penalties`), logprob gatherers (:mod:`.logprobs`).

The built-ins are registered as default plugins by module path (``gyrfalcon.plugins.sampling``,
``…penalties``, ``…logprobs``), each a thin registration of what lives here: this room sits
below the engine, so the sampler never reaches up into the plugin host. Nothing here imports torch
at import time: the API side builds the policies to run their ``validate`` (:mod:`gyrfalcon.validation`).
"""

from gyrfalcon.policies.base import (
    BatchRows,
    Gathered,
    LogitsProcessor,
    LogprobGatherer,
    NewRow,
    RowList,
    SlotTensor,
    put_rows,
    row_index,
    take_rows,
    to_device,
)

__all__ = [
    "BatchRows", "Gathered", "LogitsProcessor", "LogprobGatherer", "NewRow", "RowList", "SlotTensor",
    "put_rows", "row_index", "take_rows", "to_device",
]  # fmt: skip
