"""A PEFT LoRA folder (``adapter_config.json`` and ``adapter_model.safetensors``) as plain tensors.

What is served: ``peft_type`` LORA on the attention and MLP projections (``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``) of the decoder layers, one rank
for every module, ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``). Anything else a
folder asks for — biases, DoRA, ``modules_to_save``, per-module ranks or alphas, another module, a
rank above ``--max-lora-rank``, a shape the served layer has not — is refused with a message naming
it, before anything is served with it.
"""

from __future__ import annotations

import errno
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: the projections an adapter may target
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """Why an adapter cannot be served (one line), and the field of a load that says so."""

    def __init__(self, message: str, param: str = "lora_path", found: bool = True) -> None:
        super().__init__(message)
        #: False: what it names is not there (a 404)
        self.param, self.found = param, found


@dataclass
class LoraAdapter:
    """An adapter's low-rank factors by ``(layer, module)``: ``A`` ``[r, in]``, ``B`` ``[out, r]``,
    both fp32; a row's projection gains ``scaling · (x Aᵀ) Bᵀ``. Loaded into the registry, they
    move into its stacked factors (:mod:`~gyrfalcon.engine.lora.registry`) and ``factors`` empties."""

    name: str
    path: str
    rank: int
    scaling: float
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: one number per load (the registry's count), keying its prefix-cache blocks: a name loaded
    #: again with other weights never finds the blocks of the first
    serial: int = 0
    #: its slot in the registry's stacked factors, and the columns of the slot (set when the registry holds it)
    slot: int = -1
    columns: tuple[int, int] = (0, 0)
    #: the registry's stacked factors, and the projections any adapter it holds has factors for
    stacks: dict = field(default_factory=dict, repr=False)
    active: set = field(default_factory=set, repr=False)


def read_adapter(name: str, path: str, shapes: dict[tuple[int, str], tuple[int, int]], max_rank: int,
                 device: str = "cpu") -> LoraAdapter:  # fmt: skip
    """The adapter of the PEFT folder ``path`` for layers of ``shapes`` (``(layer, module)`` →
    ``(out, in)``), refused with an :class:`AdapterError` for anything not served (module docstring)."""
    folder, shown = Path(path), path if len(path) <= 200 else path[:200] + "…"
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    try:
        if not folder.exists():
            raise AdapterError(f"'{shown}' does not exist on the server", "lora_path", found=False)
        if not config_file.is_file() or not weights_file.is_file():
            raise AdapterError(f"'{shown}' is not a PEFT LoRA folder (adapter_config.json and adapter_model.safetensors)")
    except OSError as exc:  # a name too long for the file system (none such exists), a folder it may not read
        missing = exc.errno in (errno.ENAMETOOLONG, errno.ENOENT, errno.ENOTDIR)
        raise AdapterError(f"'{shown}' cannot be read: {exc.strerror}", found=not missing) from None
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise AdapterError(f"{config_file.name} is not JSON: {exc}") from None
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not served (LORA is)")
    for key, neutral in (("bias", "none"), ("use_dora", False), ("modules_to_save", None), ("rank_pattern", {}),
                         ("alpha_pattern", {}), ("fan_in_fan_out", False)):  # fmt: skip
        value = config.get(key)
        if value is not None and value != neutral and value not in ([], {}):
            raise AdapterError(f"adapter_config.json: {key} {config.get(key)!r} is not served")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter_config.json: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"the adapter's rank {rank} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"adapter_config.json: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    from safetensors.torch import load_file

    tensors = load_file(str(weights_file))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGETS:
            raise AdapterError(f"tensor {key} is not a LoRA factor of a served projection ({', '.join(TARGETS)})")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if (layer, module) not in shapes:
            raise AdapterError(f"tensor {key}: the served model has no layer {layer} {module}")
        halves.setdefault((layer, module), {})[half] = tensor
    adapter = LoraAdapter(name, str(path), rank, float(scaling))
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module} has lora_{''.join(pair)} without its other factor")
        out, inp = shapes[(layer, module)]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
            raise AdapterError(f"layer {layer} {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit "
                               f"a [{out}, {inp}] projection at rank {rank}")  # fmt: skip
        adapter.factors[(layer, module)] = (a.to(device, torch.float32).contiguous(), b.to(device, torch.float32).contiguous())
    if not adapter.factors:
        raise AdapterError(f"'{path}' holds no LoRA factor")
    return adapter
