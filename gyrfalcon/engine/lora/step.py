"""One step's rows by the adapter each runs with, and the low-rank products added to their projections.

Rows of different adapters (and rows of none) share the step: the base layers run once over every
row, then each adapter present adds ``scaling · (x Aᵀ) Bᵀ`` to its own rows — the rows gathered by
index, two small matmuls, the sum added back in place (the idea of vLLM's punica kernels, with torch
operators: one pass per adapter in the step, not per row).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gyrfalcon.engine.lora.peft import LoraAdapter


class LoraRows:
    """``groups``: each adapter of the step with the index tensor of its rows."""

    def __init__(self, groups: list[tuple[LoraAdapter, torch.Tensor]]) -> None:
        self.groups = groups

    @classmethod
    def of(cls, spans: Sequence[tuple[Any, int, int]], device: torch.device | str) -> LoraRows | None:
        """From ``(adapter or None, first row, row count)`` spans; None when no row has an adapter."""
        rows: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for adapter, first, count in spans:
            if adapter is not None and count:
                rows.setdefault(id(adapter), (adapter, []))[1].extend(range(first, first + count))
        if not rows:
            return None
        return cls([(adapter, torch.tensor(index, dtype=torch.long, device=device)) for adapter, index in rows.values()])

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """Add each adapter's product of ``module`` in ``layer`` to its rows of ``y`` (``x``: the
        projection's input rows, all of the step's)."""
        for adapter, index in self.groups:
            delta = adapter.delta(layer, module, x.index_select(0, index))
            if delta is not None:
                y.index_add_(0, index, delta.to(y.dtype))
