"""A weight swap's fast path: a converted GGUF served in int4 on the CPU, made again from the
folder's bits straight into memory laid out as the served memory is.

The served tensors live in a few blocks of memory (a fused q/k/v layer's nibbles are one block,
its parts' nibbles views of it). For each block one of the same size is taken, each served tensor
gets a twin at its own offset there, and the layers' kernels pack the bits into the twins
(:func:`~gyrfalcon.kernels.quant.q4.pack_into`, :func:`~gyrfalcon.kernels.quant.q8.panels_into`):
no model is built, nothing is packed twice, a fused layer is never joined from its parts, and the
folder's fp32 copies of the weights the bits replace are never read. The step loop then copies
each block once (``engine.weights._outermost``).

It stages only what matches exactly — an fp32 stream, a config of the served architecture, every
served tensor written from a source of its shape, every tensor of the folder used — and otherwise
declines (None): the caller then loads the folder as start-up does, where what does not fit is
refused and named (:func:`gyrfalcon.engine.weights.stage`, the one home of those rules)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gyrfalcon.kernels.quant.layers import TiedEmbedding
from gyrfalcon.kernels.quant.q4 import Q4Linear, pack_into
from gyrfalcon.kernels.quant.q8 import Q8Linear, panels_into
from gyrfalcon.models.gguf_bits import BITS_FILE, read_bits


class _Decline(Exception):
    """Something this path does not stage exactly: the caller loads the folder instead."""


def restage(model: Any, layers: list[Any], served: dict[str, torch.Tensor], folder: str | Path) -> dict[str, torch.Tensor] | None:
    """Each of ``served``'s tensors (:func:`~gyrfalcon.engine.weights.served_tensors` of ``model``
    and its fused ``layers``) made again from ``folder``'s GGUF bits and other tensors, in memory of
    its own with the served memory's layout; None where that does not apply or does not match
    exactly, or anything in the folder cannot be read (the load start-up does then names why)."""
    try:
        return _restage(model, layers, served, Path(folder))
    except Exception:  # noqa: BLE001 - declined: the caller's load decides, and says why it cannot serve
        return None


def _restage(model: Any, layers: list[Any], served: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor] | None:
    from safetensors import safe_open

    if (any(t.device.type != "cpu" or not t.is_contiguous() for t in served.values())
            or not any(isinstance(m, Q4Linear) for m in model.modules())
            or getattr(model, "dtype", None) != torch.float32  # (another stream rounds biases and norms on the way)
            or (folder / "model.safetensors.index.json").exists() or not _same_architecture(model, folder)):  # fmt: skip
        return None
    bits = read_bits(folder)
    files = sorted(p for p in folder.glob("*.safetensors") if p.name != BITS_FILE)
    if not bits or not files:
        return None
    blocks: dict[int, torch.Tensor] = {}
    twins = {}
    for name, tensor in served.items():
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in blocks:
            blocks[storage.data_ptr()] = torch.empty(storage.nbytes(), dtype=torch.uint8)
        twins[name] = torch.empty(0, dtype=tensor.dtype).set_(blocks[storage.data_ptr()].untyped_storage(),
                                                               tensor.storage_offset(), tensor.shape, tensor.stride())  # fmt: skip
    handles = [safe_open(str(file), framework="pt") for file in files]
    keys = {key: f for f in handles for key in f.keys()}
    writer = _Writer(twins, served)
    names = {id(m): n for n, m in model.named_modules()}
    try:
        for prefix, module in model.named_modules():
            _fill(writer, module, prefix, model, names, bits, keys)
        for i, layer in enumerate(layers):
            for part, modules in layer.parts.items():
                fused = getattr(layer, part)
                if fused is not None:  # its nibbles and scales are the parts' rows, written with them
                    _fused_bias(writer, fused, modules, names, f"fused.{i}.{part}")
        unused = set(keys) - writer.read - set(bits)
        if unused or not writer.covers_all() or set(bits) - writer.bits_used:
            return None
    except _Decline:
        return None
    return twins


def _same_architecture(model: Any, folder: Path) -> bool:
    """Whether ``folder`` has a config of the served model's architecture (the load reads it: a
    folder without one, or of another, is for it to refuse)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    served = model.config
    return (isinstance(config, dict) and config.get("model_type") == served.model_type
            and config.get("architectures") == getattr(served, "architectures", None))  # fmt: skip


class _Writer:
    """The twins written so far, by the byte ranges of their blocks (a tensor counts as written
    when its range is, whether through itself or through views of its rows)."""

    def __init__(self, twins: dict[str, torch.Tensor], served: dict[str, torch.Tensor]) -> None:
        self.twins, self.served = twins, served
        self.ranges: dict[int, list[tuple[int, int]]] = {}
        self.read: set[str] = set()
        self.bits_used: set[str] = set()

    def twin(self, name: str) -> torch.Tensor:
        twin = self.twins.get(name)
        if twin is None:
            raise _Decline(name)
        start = twin.storage_offset() * twin.element_size()
        self.ranges.setdefault(twin.untyped_storage().data_ptr(), []).append((start, start + twin.nbytes))
        return twin

    def copy(self, name: str, source: torch.Tensor) -> None:
        twin = self.twin(name)
        if source.shape != twin.shape or source.is_floating_point() != twin.is_floating_point():
            raise _Decline(name)
        twin.copy_(source)

    def covers_all(self) -> bool:
        merged = {}
        for key, ranges in self.ranges.items():
            spans = []
            for start, end in sorted(ranges):
                if spans and start <= spans[-1][1]:
                    spans[-1] = (spans[-1][0], max(spans[-1][1], end))
                else:
                    spans.append((start, end))
            merged[key] = spans
        for twin in self.twins.values():
            start = twin.storage_offset() * twin.element_size()
            spans = merged.get(twin.untyped_storage().data_ptr(), [])
            if twin.nbytes and not any(a <= start and start + twin.nbytes <= b for a, b in spans):
                return False
        return True


def _fill(writer: _Writer, module: torch.nn.Module, prefix: str, model: Any, names: dict[int, str], bits: dict,
          keys: dict[str, Any]) -> None:  # fmt: skip
    """Write ``module``'s own served tensors (not its children's)."""
    dot = f"{prefix}." if prefix else ""
    own = [n for n, t in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
           if t is not None and f"{dot}{n}" in writer.served]  # fmt: skip
    if not own:
        return
    done: set[str] = set()
    if isinstance(module, Q4Linear):
        source = bits.get(f"{dot}weight")
        if source is None or source.int4 is None or source.int4.shape != (module.out_features, module.in_features):
            raise _Decline(prefix)
        pack_into(source.int4, module.inputs, writer.twin(f"{dot}nibbles"), writer.twin(f"{dot}scales"))
        writer.bits_used.add(f"{dot}weight")
        done = {"nibbles", "scales"}
    elif isinstance(module, Q8Linear):
        embedding = model.get_input_embeddings()
        tied = isinstance(embedding, TiedEmbedding) and embedding.head[0] is module
        table = f"{names[id(embedding)]}.weight" if tied else f"{dot}weight"
        source = bits.get(table)
        if source is None or source.q8 is None or tuple(source.q8.shape) != (module.out_features, module.in_features):
            raise _Decline(prefix)
        panels_into(source.q8, source.scale8, writer.twin(f"{dot}q8"), writer.twin(f"{dot}scale"))
        writer.bits_used.add(table)
        done = {"q8", "scale"}
    for name in own:
        if name not in done:
            key = f"{dot}{name}"
            if key not in keys:
                raise _Decline(key)
            writer.copy(key, keys[key].get_tensor(key))
            writer.read.add(key)


def _fused_bias(writer: _Writer, fused: torch.nn.Module, parts: list[torch.nn.Module], names: dict[int, str],
                prefix: str) -> None:  # fmt: skip
    """A fused layer's bias: a tensor of its own, the ``parts``' biases (written already) side by
    side, zeros for a part without one."""
    if fused.bias is None:
        return
    biases = [writer.twins[f"{names[id(p)]}.bias"] if p.bias is not None else torch.zeros(p.out_features) for p in parts]
    writer.copy(f"{prefix}.bias", torch.cat(biases))
