"""The adapters an engine holds, by name: at most ``--max-loras`` of them, each checked against the
served layers when it is loaded (:func:`~gyrfalcon.engine.lora.peft.read_adapter`)."""

from __future__ import annotations

import threading
from typing import Any

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
        self._adapters: dict[str, LoraAdapter] = {}
        self._lock = threading.Lock()
        self._loads = 0

    def load(self, name: str, path: str, replace: bool = False) -> LoraAdapter:
        """Read and hold the adapter of ``path`` as ``name`` (``replace``: in place of one of that
        name); an :class:`AdapterError` when it cannot serve, its name is taken, or ``max_loras``
        are held (nothing held changes then)."""
        self._check_room(name, replace)
        adapter = read_adapter(name, path, self.shapes, self.max_rank, self.device)
        with self._lock:
            self._check_room(name, replace)
            self._loads += 1
            adapter.serial = self._loads
            self._adapters[name] = adapter
        return adapter

    def _check_room(self, name: str, replace: bool) -> None:
        if name in self._adapters and not replace:
            raise AdapterError(f"an adapter named {name!r} is loaded already (load_inplace replaces it)", "lora_name")
        if name not in self._adapters and len(self._adapters) >= self.max_loras:
            raise AdapterError(f"{self.max_loras} adapters are loaded, the most --max-loras allows", "lora_name")

    def unload(self, name: str) -> None:
        with self._lock:
            if self._adapters.pop(name, None) is None:
                raise AdapterError(f"The lora adapter '{name}' cannot be found.", "lora_name", found=False)

    def get(self, name: str) -> LoraAdapter | None:
        return self._adapters.get(name)

    def names(self) -> list[str]:
        return list(self._adapters)
