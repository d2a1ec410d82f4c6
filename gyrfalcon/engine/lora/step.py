"""One step's rows by the adapter each runs with, and the low-rank products added to their projections.

Rows of different adapters (and rows of none) share the step: the base layers run once over every
row, then each projection some adapter targets adds ``((x Aᵀ) ∘ M) Bᵀ`` to every row — ``A`` and
``B`` the registry's stacks of every slot (``B`` scaled), ``M`` ``[T, slots · r]`` one over each
row's own slot's columns and zero elsewhere, so a row gains exactly its adapter's product (a row of
none gains zeros). Two matmuls a projection whatever the mix (the idea of vLLM's punica kernels,
with torch operators).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class LoraRows:
    """``mask``: the step's ``M``; ``stacks`` and ``active``: the registry's (see the module docstring)."""

    def __init__(self, mask: torch.Tensor, stacks: dict, active: set) -> None:
        self.mask, self.stacks, self.active = mask, stacks, active

    @classmethod
    def of(cls, spans: Sequence[tuple[Any, int, int]], device: torch.device | str) -> LoraRows | None:
        """From ``(adapter or None, first row, row count)`` spans; None when no row has an adapter."""
        held = [(adapter, first, count) for adapter, first, count in spans if adapter is not None and count]
        if not held:
            return None
        stacks = held[0][0].stacks
        width = next(iter(stacks.values()))[0].shape[0]
        mask = torch.zeros(max(first + count for _, first, count in spans), width)
        for adapter, first, count in held:
            mask[first : first + count, adapter.columns[0] : adapter.columns[1]] = 1.0
        return cls(mask.to(device), stacks, held[0][0].active)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """Add every row's adapter product of ``module`` in ``layer`` to ``y`` (``x``: the
        projection's input rows, all of the step's)."""
        if (layer, module) not in self.active:
            return
        a, b = self.stacks[(layer, module)]
        if y.dtype == torch.float32:
            y.addmm_((x @ a.T).mul_(self.mask), b.T)
        else:
            y.add_((((x.float() @ a.T) * self.mask) @ b.T).to(y.dtype))
