"""The adapters an engine holds, by name: at most ``--max-loras`` of them, each checked against the
served layers when it is loaded (:func:`~gyrfalcon.engine.lora.peft.read_adapter`) and written into
a slot of every projection's stacked factors — ``A`` ``[slots · r, in]``, ``B`` transposed
``[slots · r, out]`` with the adapter's scaling in it (a slot's rows whole, for ``lora_add.c``),
``r`` the largest rank, zeros past an adapter's own — so that a
step computes every adapter's product for a projection in two matmuls
(:mod:`~gyrfalcon.engine.lora.step`). There is one slot more than ``--max-loras``: an adapter
unloaded or replaced keeps its slot while requests still run with it, and a load reclaims the slots
of those no request holds any more."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from gyrfalcon.engine.lora.peft import AdapterError, LoraAdapter, read_adapter


def projection_shapes(layers: list[Any]) -> dict[tuple[int, str], tuple[int, int]]:
    """``(layer, module)`` → ``(out, in)`` of every projection of the direct forward's ``layers``."""
    shapes = {}
    for i, layer in enumerate(layers):
        for owner, names in ((layer.attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                             (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):  # fmt: skip
            for name in names:
                module = getattr(owner, name)
                shapes[(i, name)] = (int(module.out_features), int(module.in_features))
    return shapes


class LoraRegistry:
    """Adapters by name (see the module docstring); safe to read from the step loop while another
    thread loads or unloads one."""

    def __init__(self, shapes: dict[tuple[int, str], tuple[int, int]], max_loras: int, max_rank: int,
                 device: torch.device | str) -> None:  # fmt: skip
        self.shapes, self.max_loras, self.max_rank, self.device = shapes, max_loras, max_rank, str(device)
        self.slots = max_loras + 1
        #: per ``(layer, module)``: the stacked ``A`` and (scaled) ``Bᵀ`` of every slot
        self.stacks = {key: (torch.zeros(self.slots * max_rank, columns, device=device),
                             torch.zeros(self.slots * max_rank, rows, device=device))
                       for key, (rows, columns) in shapes.items()}  # fmt: skip
        #: the projections some adapter held (or retired) has factors for: the others are left alone
        self.active: set[tuple[int, str]] = set()
        self._adapters: dict[str, LoraAdapter] = {}
        self._free = list(range(self.slots))
        self._retired: list[LoraAdapter] = []  # unloaded or replaced, their slots kept while requests hold them
        self._lock = threading.Lock()
        self._loads = 0

    def load(self, name: str, path: str, replace: bool = False, in_use: frozenset[int] = frozenset()) -> LoraAdapter:
        """Read and hold the adapter of ``path`` as ``name`` (``replace``: in place of one of that
        name); an :class:`AdapterError` when it cannot serve, its name is taken, ``max_loras`` are
        held, or no slot is free (``in_use``: the serials of the adapters requests still hold);
        nothing held changes then."""
        self._check_room(name, replace)
        adapter = read_adapter(name, path, self.shapes, self.max_rank, self.device)
        with self._lock:
            self._check_room(name, replace)
            for old in [a for a in self._retired if a.serial not in in_use]:
                self._retired.remove(old)
                self._free.append(old.slot)
            if not self._free:
                raise AdapterError("no slot is free: requests of an adapter unloaded or replaced still run (retry "
                                   "when they have finished)", "lora_name")  # fmt: skip
            self._loads += 1
            adapter.serial, adapter.slot, adapter.stacks, adapter.active = self._loads, self._free.pop(0), self.stacks, self.active
            adapter.columns = (adapter.slot * self.max_rank, (adapter.slot + 1) * self.max_rank)
            self._write(adapter)
            self.active.update(adapter.factors)
            adapter.factors = {}  # (the stacks hold them now: not twice in memory)
            if name in self._adapters:
                self._retired.append(self._adapters[name])
            self._adapters[name] = adapter
        return adapter

    @torch.no_grad()
    def _write(self, adapter: LoraAdapter) -> None:
        """The adapter's factors into its slot of every projection's stacks (zeros where it has none):
        one pass over them, the scaling multiplied in as ``B`` is transposed (on the CPU through
        numpy, whose calls cost a fraction of torch's). The slot is no row's (free): a step reading
        the stacks meanwhile multiplies it by zero."""
        first, rank, end = adapter.slot * self.max_rank, adapter.rank, (adapter.slot + 1) * self.max_rank
        scaling = np.float32(adapter.scaling)
        for key, (a_stack, bt_stack) in self.stacks.items():
            pair = adapter.factors.get(key)
            if self.device == "cpu":
                a_stack, bt_stack = a_stack.numpy(), bt_stack.numpy()
            if pair is None:
                a_stack[first:end], bt_stack[first:end] = 0, 0
                continue
            a, b = pair
            a_stack[first : first + rank] = a
            if isinstance(b, np.ndarray):
                np.multiply(b.T, scaling, out=bt_stack[first : first + rank])
            else:
                torch.mul(b.T, adapter.scaling, out=bt_stack[first : first + rank])
            a_stack[first + rank : end], bt_stack[first + rank : end] = 0, 0

    def _check_room(self, name: str, replace: bool) -> None:
        if name in self._adapters and not replace:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                               "place, set 'load_inplace' to True.", "lora_name")  # fmt: skip
        if name not in self._adapters and len(self._adapters) >= self.max_loras:
            raise AdapterError(f"{self.max_loras} adapters are loaded, the most --max-loras allows (unload one first)",
                               "lora_name")  # fmt: skip

    def unload(self, name: str) -> None:
        with self._lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                raise AdapterError(f"The lora adapter '{name}' cannot be found.", "lora_name", found=False)
            self._retired.append(adapter)

    def get(self, name: str) -> LoraAdapter | None:
        return self._adapters.get(name)

    def held(self) -> list[LoraAdapter]:
        return list(self._adapters.values())
