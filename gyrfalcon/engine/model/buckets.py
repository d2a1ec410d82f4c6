"""A static decode bucket's buffers, and what the static decode path needs of the runner.

:class:`~gyrfalcon.engine.model.captured.DecodeSteps` (captured and static steps) and its compiled
mode (:mod:`~gyrfalcon.engine.model.compiled`) both work on :class:`Bucket`; they reach the model
runner through :class:`StepRunner`, the few attributes a step needs, so that neither imports the
runner (which builds them): the three modules form no circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gyrfalcon.engine.model.attention import StepMetadata
from gyrfalcon.engine.model.heads import StepHeads


@dataclass
class Bucket:
    """One batch size and context width's static inputs, and what became of its fast paths."""

    batch: int
    width: int
    ids: torch.Tensor
    positions: torch.Tensor
    step: StepMetadata
    #: the one buffer ``ids``, ``positions`` and the step's tensors are views of
    flat: torch.Tensor
    #: what its captured graph writes at each replay
    heads: StepHeads | None = None
    graph: Any = None
    #: why this bucket's captured graph was not kept (None: it was, or none was asked for)
    failure: str | None = None
    #: the compiled step serves this bucket (checked at start-up)
    compiled: bool = False
    runs: int = field(default=0)


class StepRunner(Protocol):
    """What the static decode path uses of :class:`~gyrfalcon.engine.model.runner.ModelRunner`."""

    device: torch.device
    model: Any
    #: the KV cache (``shape``, ``block_size``)
    cache: Any
    #: "flex" or "gather"
    attention: str
    rows_in_place: bool
    logits_width: int
    #: the direct forward (its ``layer_loop``), None where transformers' runs
    direct: Any
    #: the running sequences' block table (one device tensor)
    block_table: Any
    #: the LoRA adapters' registry (``--enable-lora``), else None
    lora_registry: Any

    def run_model(self, ids: torch.Tensor, positions: torch.Tensor, step: StepMetadata, kv_offset: int) -> torch.Tensor:
        """One forward of the model over ``ids`` at ``positions``."""
        ...
