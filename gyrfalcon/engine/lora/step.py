"""One step's rows by the adapter each runs with, and the low-rank products added to their projections.

Rows of different adapters (and rows of none) share the step: the base layers run once over every
row, then each projection some adapter targets adds ``(x A_sᵀ) B_sᵀ`` to every row of slot ``s``
— ``A`` and ``Bᵀ`` the registry's stacks of every slot (``B`` scaled), a row of none gaining
nothing (the idea of vLLM's punica kernels). On the CPU ``lora_add.c`` computes them (each row in
one fixed order, so it gets the same bits alone and in any batch, and ``decode_layers.c`` calls
the same kernel for steps of decode rows); elsewhere two matmuls a projection over the product
masked to each row's own slot's columns.

A static decode step (:mod:`~gyrfalcon.engine.model.captured`) holds its rows' slots in a buffer
of its bucket on the device (:meth:`LoraRows.static`). Compiled on the CPU it calls the kernel
through the operator ``gyrfalcon::lora_product`` for every projection; captured as a CUDA graph it
runs the masked matmuls for every projection, the mask computed on the device from that buffer, so
that a replay serves whichever adapters the rows hold then, and adapters loaded after the capture.
Both compute every projection, whichever adapters are loaded: a projection no adapter targets has
zeros in every slot, so it adds nothing, as the eager step, which skips it, does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gyrfalcon.engine.lora.peft import TARGETS
from gyrfalcon.kernels import native


class LoraRows:
    """``slots``: each row's slot (-1: the base model's), ``[T]`` on the CPU (a static step's: on
    its device); ``rank``: the columns of a slot; ``stacks`` and ``active``: the registry's (see the
    module docstring)."""

    def __init__(self, slots: torch.Tensor, rank: int, stacks: dict, active: set, device: torch.device | str,
                 every_projection: bool = False) -> None:  # fmt: skip
        self.slots, self.rank, self.stacks, self.active = slots, rank, stacks, active
        self.width = next(iter(stacks.values()))[0].shape[0]
        self._device = device
        self._mask: torch.Tensor | None = None
        #: every projection computed, none skipped for want of an adapter (a step captured once, replayed later)
        self.every_projection = every_projection

    @classmethod
    def static(cls, rows: int, registry: Any, device: torch.device | str, every_projection: bool = False) -> LoraRows:
        """Rows of a static decode step (a bucket of ``rows``), every one the base model's until a
        step writes its slot into :attr:`slots` (:meth:`fill`), a buffer on ``device``; over
        ``registry``'s stacks. ``every_projection``: for a step captured as a CUDA graph, which
        is captured before any adapter is loaded."""
        slots = torch.full((rows,), -1, dtype=torch.long, device=device)
        return cls(slots, registry.max_rank, registry.stacks, registry.active, device, every_projection)

    def fill(self, adapters: Sequence[Any]) -> None:
        """Each row's slot from ``adapters`` (an adapter or None per row), the rest the base model's."""
        slots = [-1 if adapter is None else adapter.slot for adapter in adapters]
        self.slots.copy_(torch.tensor(slots + [-1] * (len(self.slots) - len(slots)), dtype=torch.long))
        self.renew()  # (made again from these slots where the operators need it)

    def renew(self) -> None:
        """The rows' mask made again from :attr:`slots` at its next use: a step being captured
        computes it inside the graph, so that each replay reads the slots of its own rows."""
        self._mask = None

    @classmethod
    def of(cls, spans: Sequence[tuple[Any, int, int]], device: torch.device | str) -> LoraRows | None:
        """From ``(adapter or None, first row, row count)`` spans; None when no row has an adapter."""
        held = [(adapter, first, count) for adapter, first, count in spans if adapter is not None and count]
        if not held:
            return None
        first_adapter = held[0][0]
        slots = torch.full((max(first + count for _, first, count in spans),), -1, dtype=torch.long)
        for adapter, first, count in held:
            slots[first : first + count] = adapter.slot
        rank = first_adapter.columns[1] - first_adapter.columns[0]
        return cls(slots, rank, first_adapter.stacks, first_adapter.active, device)

    @property
    def mask(self) -> torch.Tensor:
        """``[T, width]``: one over each row's own slot's columns, zero elsewhere (the operators' way)."""
        if self._mask is None:  # (on the slots' device: no host copy inside a captured step)
            columns = torch.arange(self.width, device=self.slots.device) // self.rank
            self._mask = (columns[None, :] == self.slots[:, None]).float().to(self._device)
        return self._mask

    def table(self, layers: int) -> torch.Tensor:
        """``[layers, 14]``: each layer's ``A`` and ``Bᵀ`` stacks' addresses for every projection of
        :data:`~gyrfalcon.engine.lora.peft.TARGETS`, in its order (0 where no adapter targets it):
        ``decode_layers.c``'s ``lora_table``."""
        rows = []
        for layer in range(layers):
            row = []
            for module in TARGETS:
                a, b = self.stacks[(layer, module)] if (layer, module) in self.active else (None, None)
                row += [0, 0] if a is None else [a.data_ptr(), b.data_ptr()]
            rows.append(row)
        return torch.tensor(rows, dtype=torch.long)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """Add every row's adapter product of ``module`` in ``layer`` to ``y`` (``x``: the
        projection's input rows, all of the step's)."""
        if torch.compiler.is_compiling():  # the operator keeps the kernel inside the graph
            a, bt = self.stacks[(layer, module)]
            y += _lora_product(x, a, bt, self.slots, self.rank)
            return
        if (layer, module) not in self.active and not self.every_projection:
            return
        a, bt = self.stacks[(layer, module)]
        kernels = native.loaded()
        if (kernels is not None and y.dtype == x.dtype == torch.float32 and y.device.type == "cpu"
                and y.stride(-1) == 1 and x.stride(-1) == 1 and x.shape[0] == self.slots.shape[0]):  # fmt: skip
            status = kernels.lora_add(x.data_ptr(), x.stride(0), a.data_ptr(), bt.data_ptr(), self.slots.data_ptr(),
                                      y.data_ptr(), y.stride(0), x.shape[0], x.shape[1], y.shape[1], self.rank,
                                      self.width, native.threads())  # fmt: skip
            if status:
                raise ValueError(f"lora_add refused a rank of {self.rank} (status {status})")
        elif y.dtype == torch.float32:
            y.addmm_((x @ a.T).mul_(self.mask), bt)
        else:
            y.add_((((x.float() @ a.T) * self.mask) @ bt).to(y.dtype))


def _product(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor, rank: int) -> torch.Tensor:
    """Each row's adapter product alone (``[T, out]``, zeros for a row of none), by ``lora_add``
    into zeros: added to ``y`` it gives the bits the kernel's own addition into ``y`` does."""
    kernels = native.loaded()
    if kernels is None or x.shape[0] != slots.shape[0] or x.device.type != "cpu":
        raise ValueError(f"lora_product takes [T, in] CPU rows beside T slots and the kernels, got {list(x.shape)} "
                         f"rows and {slots.shape[0]} slots")  # fmt: skip
    x = x if x.stride(-1) == 1 and x.dtype == torch.float32 else x.float().contiguous()
    y = torch.zeros(x.shape[0], bt.shape[1], dtype=torch.float32)
    if x.shape[0]:
        status = kernels.lora_add(x.data_ptr(), x.stride(0), a.data_ptr(), bt.data_ptr(), slots.data_ptr(),
                                          y.data_ptr(), y.stride(0), x.shape[0], x.shape[1], y.shape[1], rank,
                                          a.shape[0], native.threads())  # fmt: skip
        if status:
            raise ValueError(f"lora_add refused a rank of {rank} (status {status})")
    return y


_lora_product = native.operator("lora_product(Tensor x, Tensor a, Tensor bt, Tensor slots, int rank) -> Tensor", _product,
                                lambda x, a, bt, slots, rank: x.new_empty((x.shape[0], bt.shape[1]), dtype=torch.float32))
