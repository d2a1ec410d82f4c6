"""The quantised bits of a GGUF, kept beside its dequantised folder so the server can serve them as they are.

When a GGUF is converted (:mod:`gyrfalcon.models.default`), transformers dequantises it into an
ordinary fp32 folder — the reference model, loaded by ``--quantization none`` and by any plain
transformers tool. :func:`extract_bits` then writes the file :data:`BITS_FILE` into the same folder:
for each ``Q4_0``/``Q4_1``/``Q8_0`` tensor, under its Hugging Face name, the raw 4- or 8-bit values
and their fp16 scales (layouts of :mod:`gyrfalcon.kernels.quant.weights`). A tensor is kept
only if dequantising the kept bits gives exactly, bit for bit, the weight transformers wrote: that
proves the name mapping and the row permutations (Llama's q/k rows) were applied the same way.
Other tensor types (K-quants, fp16) are left out; ``--quantization int4`` re-quantises those from
the folder's weights and prints the error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gyrfalcon.kernels.quant.weights import GROUP, Int4Weights

log = logging.getLogger(__name__)

BITS_FILE = "gyrfalcon-gguf-bits.safetensors"
#: GGML types whose blocks map onto the neutral layouts (block size 32, fp16 scales)
MAPPED_TYPES = ("Q4_0", "Q4_1", "Q8_0")


@dataclass
class GGUFBits:
    """One tensor's bits: ``kind`` is the GGML type; int4 kinds fill ``int4``; ``Q8_0`` fills
    ``q8`` (``[N, K]`` int8) and ``scale8`` (``[N, K // 32]`` fp16: ``w = scale8 * q8`` per block)."""

    kind: str
    int4: Int4Weights | None = None
    q8: torch.Tensor | None = None
    scale8: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """fp32, in the same operation order as gguf-py (so that an exact mapping compares equal)."""
        if self.int4 is not None:
            return self.int4.dequantize()
        assert self.q8 is not None and self.scale8 is not None
        n, k = self.q8.shape
        blocks = self.scale8.float()[..., None] * self.q8.reshape(n, k // GROUP, GROUP).float()
        return blocks.reshape(n, k)


def _split_blocks(kind: str, data: np.ndarray) -> dict[str, np.ndarray]:
    """``data`` ``[N, bytes]`` of one GGML tensor → its components, each ``[N, ...]``."""
    rows = data.shape[0]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = data.reshape(rows, -1, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "Q8_0":
        return {"q8": blocks[..., 2:].copy().view(np.int8).reshape(rows, -1), "scale8": d}
    packed = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)  # ggml: low nibbles first
    minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0] if kind == "Q4_1" else (d * np.float16(-8))
    return {"q": q, "scale": d, "minimum": minimum}


def _bits(kind: str, parts: dict[str, np.ndarray]) -> GGUFBits:
    t = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in parts.items()}
    if kind == "Q8_0":
        return GGUFBits(kind, q8=t["q8"], scale8=t["scale8"])
    return GGUFBits(kind, int4=Int4Weights(t["q"], t["scale"], t["minimum"]))


def extract_bits(gguf_path: str | Path, model, out: str | Path) -> dict[str, int]:
    """Write :data:`BITS_FILE` for ``model`` (the model transformers dequantised from ``gguf_path``)
    into ``out``; returns how many tensors of each GGML type were kept (and ``mismatched``)."""
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    reader = GGUFReader(str(gguf_path))
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    counts: dict[str, int] = {"mismatched": 0}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in MAPPED_TYPES or tensor.data.ndim != 2 or tensor.name not in names:
            continue
        parts = _split_blocks(kind, np.asarray(tensor.data))
        processed = {}
        for part, value in parts.items():  # the same row permutation transformers applied to the weight
            result = processor.process(weights=value, name=tensor.name, tensor_key_mapping=names, parsed_parameters={})
            processed[part] = result.weights
        hf_name = names[tensor.name]
        bits = _bits(kind, processed)
        reference, values = state.get(hf_name), bits.dequantize()
        if reference is None or reference.shape != values.shape or not torch.equal(values, reference.float()):
            counts["mismatched"] += 1
            log.warning("GGUF tensor %s (%s) does not map exactly onto %s: left to re-quantisation", tensor.name, kind, hf_name)
            continue
        kinds[hf_name] = kind
        if bits.int4 is not None:
            tensors[f"{hf_name}.nibbles"] = bits.int4.packed_nibbles().contiguous()
            tensors[f"{hf_name}.scale"] = bits.int4.scale.contiguous()
            tensors[f"{hf_name}.minimum"] = bits.int4.minimum.contiguous()
        else:
            tensors[f"{hf_name}.q8"] = bits.q8.contiguous()
            tensors[f"{hf_name}.scale8"] = bits.scale8.contiguous()
        counts[kind] = counts.get(kind, 0) + 1
    save_file(tensors, str(Path(out) / BITS_FILE), metadata={name: kind for name, kind in kinds.items()})
    return counts


def read_bits(folder: str | Path) -> dict[str, GGUFBits] | None:
    """The bits kept beside a converted GGUF folder, by Hugging Face weight name (None: no such file)."""
    from safetensors import safe_open

    path = Path(folder) / BITS_FILE
    if not path.is_file():
        return None
    out: dict[str, GGUFBits] = {}
    with safe_open(str(path), framework="pt") as f:
        for name, kind in (f.metadata() or {}).items():
            if kind == "Q8_0":
                out[name] = GGUFBits(kind, q8=f.get_tensor(f"{name}.q8"), scale8=f.get_tensor(f"{name}.scale8"))
            else:
                int4 = Int4Weights.from_nibbles(f.get_tensor(f"{name}.nibbles"), f.get_tensor(f"{name}.scale"),
                                                f.get_tensor(f"{name}.minimum"))  # fmt: skip
                out[name] = GGUFBits(kind, int4=int4)
    return out
