"""``--quantization``: which layers of a loaded model run in which weight-only kernel, and from what bits.

:func:`resolve_quantization` turns the setting into a mode; :func:`quantize_model` swaps the
model's linear layers for :mod:`~gyrfalcon.kernels.quant.layers` in place and returns a
:class:`QuantizationReport`, the start-up line saying what each kind of layer runs in.

- ``int4``: every linear layer of the decoder blocks in int4 groups of 32. Bits kept from a GGUF
  (``Q4_0``/``Q4_1``, see :mod:`gyrfalcon.models.gguf_bits`) are used exactly; any other weight
  is quantised (min/max per group, ``Q4_1``'s rule) and its error printed.
- ``int8``: the same layers in int8 with one scale per output row (``Q8_0`` and 4-bit bits are
  re-quantised from their exact dequantised values; error printed).
- The output head runs in :data:`HEAD_KERNEL` under both. An fp32 head on the CPU reads a GGUF's
  ``Q8_0`` table as it is (:class:`~gyrfalcon.kernels.quant.q8.Q8Linear`), else goes through
  :class:`~gyrfalcon.kernels.quant.layers.PackedLinear`; the rows of either do not depend on
  the batch. When the head is quantised, bf16 or ``Q8_0``, a tied input embedding reads its rows
  from the head's table (one copy). Measured on the default model
  (docs/kernels.md, quality table): against the fp32 reference an fp32 head moves log-probabilities by
  0.033 nats, bf16 by 0.040, int8 by 0.072, int4 by 0.48 — and the kernels' bf16 outputs round
  logits to 1/8 near 25, which makes exact argmax ties between tokens fp32 tells apart.
- The matmuls take their inputs in ``compute`` dtype (bf16 where the CPU has it,
  :func:`gyrfalcon.models.loading.kernel_dtype`); norms, attention and the residual stream stay in
  the model's dtype.
- ``auto``: a GGUF keeps its bits (``int4``) where the activations are in a dtype the kernel is
  fast in (bf16/fp16); any other checkpoint keeps its dtype (``none``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gyrfalcon.kernels.quant.layers import (
    CastLinear,
    Int4Linear,
    Int8Linear,
    PackedLinear,
    TiedEmbedding,
    UnsupportedQuantization,
    int4_fits,
    int4_kernel,
    int8_kernel,
)
from gyrfalcon.kernels.native.cpu import cpu
from gyrfalcon.kernels.quant.q4 import KERNELS as Q4_INPUTS
from gyrfalcon.kernels.quant.q4 import SOURCES as Q4_SOURCES
from gyrfalcon.kernels.quant.q4 import Q4Linear, q4_fits, q4_kernel
from gyrfalcon.kernels.quant.q8 import Q8Embedding, Q8Linear
from gyrfalcon.kernels.quant.weights import GROUP, Int4Weights, Int8Weights, relative_error

from gyrfalcon.kernels.quant import QUANTIZATIONS
#: the output head's kernel when the layers are quantised: ``none`` (the model's dtype: fp32 logits,
#: no rounding ties), ``bf16`` (dense, :class:`CastLinear`: bf16 logits), ``int8`` (per row: at
#: batch 1 a third of bf16's time, past the quality bar) or ``int4``
HEAD_KERNEL = "none"


def resolve_quantization(setting: str, has_gguf_bits: bool, dtype: torch.dtype, device: str) -> str:
    """The mode for ``--quantization setting`` (see the module docstring for ``auto``)."""
    if setting not in QUANTIZATIONS:
        raise UnsupportedQuantization(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {setting!r}")
    if setting != "auto":
        return setting
    where = torch.device(device)
    fast = (where.type == "cpu" and q4_kernel()) or (dtype in (torch.bfloat16, torch.float16) and int4_kernel(where) is not None)
    return "int4" if has_gguf_bits and fast else "none"


@dataclass
class _Kind:
    """What one kind of layer became: counts by source, and the worst re-quantisation error."""

    kernel: str = ""
    exact: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    requantized: int = 0
    kept: int = 0
    worst_error: float = 0.0
    #: which kernels the layers run in (int4: ours or torch's, and their inputs' dtype)
    kernels: set[str] = field(default_factory=set)
    #: why our int4 kernel is not served (then torch's is)
    fallback: str | None = None

    def describe(self) -> str:
        parts = [f"{count} from the GGUF's {kind} bits (exact)" for kind, count in sorted(self.exact.items())]
        if self.kernels:
            parts.insert(0, " and ".join(sorted(self.kernels)) + (f" ({self.fallback})" if self.fallback else ""))
        if self.requantized:
            parts.append(f"{self.requantized} quantised at load (largest relative error {self.worst_error:.2%})")
        if self.kernel.startswith("dense"):
            return self.kernel
        if self.kept:
            parts.append(f"{self.kept} kept in the model dtype (no kernel for their shape)")
        return f"{self.kernel}: " + ", ".join(parts)


@dataclass
class QuantizationReport:
    """The start-up line: ``mode``, the model's dtype and the matmuls' input dtype, and per kind of
    layer what it runs in."""

    mode: str
    dtype: torch.dtype
    compute: torch.dtype | None = None
    kinds: dict[str, str] = field(default_factory=dict)
    #: the device the kernels were chosen for (on the CPU its model and instruction set, :mod:`.cpu`)
    device: str = ""

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        where = f" on {self.device}" if self.device else ""
        if self.mode == "none":
            return f"weights{where}: --quantization none, every layer in {dtype}"
        compute = str(self.compute).removeprefix("torch.")
        layers = "; ".join(f"{name} {what}" for name, what in self.kinds.items())
        return f"weights{where}: --quantization {self.mode}, model in {dtype}, matmul inputs in {compute}; {layers}"


#: input formats, finest first
_ROUNDINGS = (torch.float64, torch.float32, torch.int16, torch.float16, torch.bfloat16, torch.int8)


def coarsest(*formats: torch.dtype) -> torch.dtype:
    """The coarsest of ``formats`` (fp32 < int16 (15 bits a block of 32) < fp16 < bf16 < int8)."""
    return max(formats, key=lambda f: _ROUNDINGS.index(f) if f in _ROUNDINGS else 0)


def matmul_inputs(model: torch.nn.Module) -> torch.dtype:
    """The coarsest format ``model``'s matmuls round their inputs to: the model's dtype, or a
    quantised layer's input format where it is coarser (how far two forwards may drift apart)."""
    formats = {next(model.parameters()).dtype}
    formats.update(m.dtype for m in model.modules() if isinstance(m, (Q4Linear, Int4Linear, Int8Linear, CastLinear)))
    return coarsest(*formats)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _convert(module: torch.nn.Linear, name: str, kernel: str, bits, dtype, device, kind: _Kind,
             kernels: Path | None = None) -> torch.nn.Module:  # fmt: skip
    """``module`` as an int4/int8 (or bf16 ``CastLinear``) layer, from the GGUF's bits where they fit, else quantised."""
    weight_name = f"{name}.weight"
    source = bits.get(weight_name) if bits else None
    n, k = module.weight.shape
    if kernel == "bf16":
        kind.kept += 1
        return CastLinear(module.weight if source is None else source.dequantize(), module.bias, torch.bfloat16, device)
    if kernel == "int4":
        exact = source is not None and source.int4 is not None
        weights = source.int4 if exact else None
        layer = None
        if device.type == "cpu" and dtype in Q4_INPUTS and q4_kernel() and q4_fits(n, k) and kind.fallback is None:
            weights = weights or _requantize(Int4Weights, module, source, kind)
            try:
                layer = Q4Linear(weights, module.bias, kernels, dtype)
            except UnsupportedQuantization as error:  # no C compiler: torch's kernel, and the line says why
                kind.fallback = str(error)
        if layer is None and not int4_fits(n, k, device):
            kind.kept += 1
            return module
        if layer is None:
            weights = weights or _requantize(Int4Weights, module, source, kind)
            layer = Int4Linear(weights, module.bias, torch.bfloat16 if dtype in Q4_INPUTS and cpu().avx2 else dtype, device)
        kind.kernels.add(f"{Q4_SOURCES[layer.dtype]}, {_name(layer.dtype)} inputs" if isinstance(layer, Q4Linear)
                         else f"torch's kernel, {_name(layer.dtype)} inputs")  # fmt: skip
        if exact:
            kind.exact[source.kind] += 1
        return layer
    return Int8Linear(_requantize(Int8Weights, module, source, kind), module.bias, dtype, device)


def _requantize(layout, module: torch.nn.Linear, source, kind: _Kind):
    """``module``'s weight (or the exact values of its GGUF bits) quantised into ``layout``; the
    error is counted in ``kind``."""
    reference = source.dequantize() if source is not None else module.weight
    weights = layout.quantize(reference)
    kind.requantized += 1
    kind.worst_error = max(kind.worst_error, relative_error(reference, weights.dequantize()))
    return weights


def _set(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


@torch.no_grad()
def quantize_model(model, mode: str, bits: dict | None, compute: torch.dtype, device: str,
                   head: str = HEAD_KERNEL, kernels: Path | None = None) -> QuantizationReport:  # fmt: skip
    """Swap ``model``'s linear layers (in place) for ``mode``'s kernels, their inputs in ``compute``
    dtype; ``bits``: a converted GGUF's (:func:`gyrfalcon.models.gguf_bits.read_bits`), None for
    any other checkpoint; ``kernels``: the folder C kernels are built in (see
    :mod:`~gyrfalcon.kernels.native`). Raises :class:`UnsupportedQuantization` where
    ``device`` has no kernel."""
    stream = next(model.parameters()).dtype
    report = QuantizationReport(mode, stream, compute, device=cpu().describe() if device == "cpu" else device)
    if mode == "none":
        return report
    where = torch.device(device)
    if (int4_kernel(where) if mode == "int4" else int8_kernel(where)) is None:
        raise UnsupportedQuantization(f"--quantization {mode}: torch {torch.__version__} has no {mode} weight-only "
                                      f"kernel on {where.type}")  # fmt: skip
    output = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    tied = output is not None and embedding is not None and output.weight is embedding.weight
    names = {id(m): n for n, m in model.named_modules()}
    layers = _Kind(f"int4 g{GROUP}" if mode == "int4" else "int8 per row")
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and module is not output:
            _set(model, name, _convert(module, name, mode, bits, compute, where, layers, kernels))
    report.kinds["linear layers"] = layers.describe()
    if output is not None and head != "none":
        head_kind = _Kind({"int4": f"int4 g{GROUP}", "int8": "int8 per row"}.get(head, f"dense {head}"))
        head_name = names[id(output)]
        # a tied head's bits are stored under the embedding's name (GGUF's token_embd)
        source = {f"{head_name}.weight": bits[f"{names[id(embedding)]}.weight"]} if tied and bits and \
            f"{names[id(embedding)]}.weight" in bits else bits  # fmt: skip
        new_head = _convert(output, head_name, head, source, compute, where, head_kind)
        _set(model, head_name, new_head)
        report.kinds["output head"] = head_kind.describe()
        if tied and isinstance(new_head, (Int8Linear, CastLinear)):
            _set(model, names[id(embedding)], TiedEmbedding(new_head, stream, getattr(embedding, "padding_idx", None)))
            report.kinds["input embedding"] = "reads the tied head's rows"
        model.config.tie_word_embeddings = False  # the tie is now the layers' own business
    if output is not None and head == "none" and _packs(output, where):
        table = bits.get(f"{names[id(embedding) if tied else id(output)]}.weight") if bits else None
        _fp32_head(model, names, table if table is not None and table.q8 is not None else None, tied, report, kernels)
    if "input embedding" not in report.kinds and embedding is not None:
        report.kinds["input embedding"] = str(embedding.weight.dtype).removeprefix("torch.")
    return report


def _fp32_head(model, names: dict[int, str], q8, tied: bool, report: QuantizationReport, kernels: Path | None) -> None:
    """The fp32 head on the CPU: from a GGUF's ``Q8_0`` table (``q8``, the head's bits or a tied
    table's) through :class:`Q8Linear`, its tied embedding reading the same bits; else — no such
    table, or no kernel built here — through :class:`PackedLinear` (from the table's values where
    there is one, and the embedding looks its rows up in the bits: the folder's fp32 table is never
    kept)."""
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    padding = getattr(embedding, "padding_idx", None)
    reason = ""
    if q8 is not None:
        try:
            head = Q8Linear(q8.q8, q8.scale8, output.bias, kernels)
        except UnsupportedQuantization as error:
            reason = f"; the Q8_0 kernel is not served: {error}"
        else:
            _set(model, names[id(output)], head)
            report.kinds["output head"] = "the GGUF's Q8_0 bits, float32 logits (q8_linear.c: rows alike at any batch size)"
            if tied:
                _set(model, names[id(embedding)], TiedEmbedding(head, report.dtype, padding))
                report.kinds["input embedding"] = "reads the tied head's Q8_0 rows (exact)"
                model.config.tie_word_embeddings = False
            return
    try:
        packed = PackedLinear(q8.dequantize() if q8 is not None else output.weight, output.bias, keep_weight=q8 is None)
    except UnsupportedQuantization as error:
        report.kinds["output head"] = f"float32 ({error})"
        return
    _set(model, names[id(output)], packed)
    report.kinds["output head"] = f"float32 (oneDNN, its rows computed alike at any batch size){reason}"
    if q8 is not None and tied:
        _set(model, names[id(embedding)], Q8Embedding(q8.q8, q8.scale8, report.dtype, padding))
        model.config.tie_word_embeddings = False
        report.kinds["input embedding"] = "the GGUF's Q8_0 rows, dequantised as they are looked up (exact)"


def _packs(layer: torch.nn.Module, device: torch.device) -> bool:
    """Whether a dense fp32 head on the CPU is one for :class:`PackedLinear` (which refuses a build
    without its kernel: the start-up line then says so)."""
    return type(layer) is torch.nn.Linear and device.type == "cpu" and layer.weight.dtype == torch.float32
