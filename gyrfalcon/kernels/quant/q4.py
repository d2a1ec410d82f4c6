"""int4 weights in groups of 32 (a GGUF's ``Q4_1``/``Q4_0`` blocks) on the CPU, through C kernels of
our own (:mod:`~gyrfalcon.kernels.native`), with the inputs in one of three formats:

- ``int16`` (``q4q16_linear`` in ``q4q8_linear.c``): each input row rounded to 15 bits per block of
  32, held as two int8 parts, and multiplied in integers, exactly — the default;
- ``int8`` (``q4q8_linear.c``): each input row rounded to int8 per block of 32, as llama.cpp's
  ``Q8_1``, and multiplied in integers, exactly (vpmaddubsw, or vpdpbusd with AVX-512 VNNI);
- ``float32`` (``q4_linear.c``): fp32 inputs times the exactly dequantised weights, a chain of fused
  multiply-adds per output: the fp32 reference model's product.

Whatever the format, each output is computed in one fixed order whatever the rows beside it (the same bits
alone and in any batch) and on AVX2 and AVX-512 alike. Which one serves is chosen per instruction
set by measurement (:data:`INPUTS`, docs/kernels.md). On the default model, against the fp32 model:
fp32 inputs 0.0000 nats, int16 inputs 0.0006, int8 inputs 0.03 to 0.10 (torch's int4 kernel with
bf16 inputs, the one fast path it has on a CPU, 0.0325).
"""

from __future__ import annotations

from pathlib import Path

import torch

from gyrfalcon.kernels.native import KernelUnavailable, library, loaded, operator, threads
from gyrfalcon.kernels.native.cpu import cpu
from gyrfalcon.kernels.quant.layers import UnsupportedQuantization, check_rows_alone
from gyrfalcon.kernels.quant.weights import GROUP, Int4Weights

#: output columns of one panel of the kernels' layouts
PANEL = 16
#: the input format of each instruction set unless ``--matmul-inputs`` says otherwise: int16 (15 bits
#: a block of 32, two int8 parts) on both. Measured on a Zen 4 (``python -m gyrfalcon.bench.kernels``,
#: docs/kernels.md): a step's 120 products of the default model at one row from memory take 2.6 ms
#: against 4.6 with fp32 inputs (AVX2) and 2.6 against 4.1 (AVX-512 VNNI), at sixteen rows 20.6
#: against 20.2 and 15.1 against 20.0; log-probabilities move by 0.0006 nats from the fp32 model
#: (fp32 inputs 0.0000; int8 inputs, less arithmetic still, 0.03 to 0.10 — past the 0.05 bar)
INPUTS = {"AVX2": torch.int16, "AVX512": torch.int16}
#: each input format's kernel (by name, in the native library)
KERNELS = {torch.int8: "q4q8_linear", torch.int16: "q4q16_linear", torch.float32: "q4_linear"}
#: where each input format's kernel is, for the start-up line
SOURCES = {torch.int8: "q4q8_linear.c", torch.int16: "q4q8_linear.c's q4q16_linear", torch.float32: "q4_linear.c"}
#: the formats read through ``q4q8_linear.c``'s layout (:func:`pack`)
INTEGER_INPUTS = (torch.int8, torch.int16)
#: each input format's code where a kernel's caller passes it as an integer (the operator,
#: ``decode_layers.c``'s ``inputs``)
INPUT_CODES = {torch.float32: 0, torch.int8: 1, torch.int16: 2}
_FORMATS = {code: inputs for inputs, code in INPUT_CODES.items()}


def q4_kernel() -> bool:
    """Whether this CPU has the instructions the kernels are written for (AVX2 with F16C, or AVX-512)."""
    here = cpu()
    return here.avx512 or (here.avx2 and "f16c" in here.flags)


def q4_inputs() -> torch.dtype:
    """The input format the kernels take on this CPU (:data:`INPUTS`)."""
    here = cpu()
    return INPUTS["AVX512" if here.avx512 else "AVX2"]


def q4_fits(n: int, k: int) -> bool:
    """Whether an ``[n, k]`` weight has a shape the kernels take."""
    return n % PANEL == 0 and k % GROUP == 0


def packed_shapes(n: int, k: int, inputs: torch.dtype) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of :func:`pack`'s ``nibbles`` and ``scales`` for an ``[n, k]`` weight."""
    nibbles = (n // PANEL, k // 8, 64) if inputs in INTEGER_INPUTS else (n // PANEL, k // 2, PANEL)
    return nibbles, (n // PANEL, k // GROUP, 2, PANEL)


def pack(weights: Int4Weights, inputs: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``weights`` in the layout of ``inputs``' kernel — ``nibbles`` per panel of 16 output columns:
    for ``float32`` ``[N / 16, K / 2, 16]`` (byte ``j`` of pair ``t``: column ``16p + j``'s weights
    ``2t`` and ``2t + 1``, low nibble first), for ``int8`` ``[N / 16, K / 8, 64]`` (byte ``4c + j``
    of group ``g``: column ``16p + c``'s weights ``8g + j`` and ``8g + 4 + j``) — and ``scales``
    ``[N / 16, K / 32, 2, 16]`` fp16 (each block's scales, then its minimums). The scales must be
    fp16 values (a GGUF's are; :meth:`Int4Weights.quantize` rounds them so)."""
    shapes = packed_shapes(*weights.shape, inputs)
    nibbles, scales = torch.empty(shapes[0], dtype=torch.uint8), torch.empty(shapes[1], dtype=torch.float16)
    pack_into(weights, inputs, nibbles, scales)
    return nibbles, scales


def pack_into(weights: Int4Weights, inputs: torch.dtype, nibbles: torch.Tensor, scales: torch.Tensor) -> None:
    """:func:`pack` into ``nibbles`` and ``scales``: contiguous CPU tensors of its shapes (a served
    layer's own memory, or rows of a fused layer's: a weight swap packs into memory laid out as
    the served tensors are)."""
    n, k = weights.shape
    if (tuple(nibbles.shape), tuple(scales.shape)) != packed_shapes(n, k, inputs) or not (
            nibbles.is_contiguous() and scales.is_contiguous()):  # fmt: skip
        raise ValueError(f"an [{n}, {k}] int4 weight packs into {packed_shapes(n, k, inputs)}, contiguous")
    if any(tuple(p.shape) != (n, k // GROUP) for p in (weights.scale, weights.minimum)) or (
            weights.nibbles is not None and weights.nibbles.dim() != 2):  # (the kernels read that many)  # fmt: skip
        raise ValueError(f"an [{n}, {k}] int4 weight has [{n}, {k // GROUP}] scales and minimums")
    if weights.nibbles is not None:
        _from_file_nibbles(weights.nibbles, n, k, inputs, nibbles)
    elif inputs in INTEGER_INPUTS:
        v = weights.q.to(torch.uint8).reshape(n // PANEL, PANEL, k // 8, 2, 4)
        nibbles.copy_((v[:, :, :, 0] | (v[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(n // PANEL, k // 8, 64))
    else:
        v = weights.q.to(torch.uint8).reshape(n // PANEL, PANEL, k // 2, 2)
        nibbles.copy_((v[..., 0] | (v[..., 1] << 4)).permute(0, 2, 1))
    parts = [weights.scale, weights.minimum]
    if any(p.dtype != torch.float16 and not torch.equal(p.half().float(), p.float()) for p in parts):
        raise UnsupportedQuantization("the int4 kernels take fp16 scales and minimums")
    kernels = loaded()
    if kernels is not None and all(p.device.type == "cpu" for p in parts):  # one pass in C
        scale, minimum = (p.half().contiguous() for p in parts)
        if kernels.q4_pack_scales(scale.data_ptr(), minimum.data_ptr(), scales.data_ptr(), n, k) == 0:
            return
    scales.copy_(torch.stack([p.half().reshape(n // PANEL, PANEL, k // GROUP) for p in parts], 2).permute(0, 3, 2, 1))


def _from_file_nibbles(disk: torch.Tensor, n: int, k: int, inputs: torch.dtype, out: torch.Tensor) -> None:
    """:func:`pack`'s nibbles straight from a file's (``[N, K // 2]``, weights ``2t`` and ``2t + 1``
    in byte ``t``) into ``out``, without unpacking each weight: the float layout takes each column's
    bytes as they are; the integer one wants, in each group of 8 weights, byte ``j`` to hold weights
    ``j`` and ``4 + j``: the group's four bytes read as one little-endian word, their nibbles
    ``q0 q1 .. q7`` shuffled to ``q0 q4 q1 q5 q2 q6 q3 q7`` by two swaps (bytes 1 and 2, then the
    middle nibbles of each half)."""
    if inputs not in INTEGER_INPUTS:
        out.copy_(disk.reshape(n // PANEL, PANEL, k // 2).permute(0, 2, 1))
        return
    kernels = loaded()
    if kernels is not None and disk.device.type == "cpu":  # one pass in C (the ops below: eight over the bytes)
        disk = disk.contiguous()
        if kernels.q4_pack_nibbles(disk.data_ptr(), out.data_ptr(), n, k, threads()) == 0:
            return
    x = disk.contiguous().view(torch.int32)
    t = (x ^ (x >> 8)) & 0x0000FF00
    x = x ^ t ^ (t << 8)
    t = (x ^ (x >> 4)) & 0x00F000F0
    x = x ^ t ^ (t << 4)
    out.copy_(x.view(torch.uint8).reshape(n // PANEL, PANEL, k // 8, 4).permute(0, 2, 1, 3).reshape(n // PANEL, k // 8, 64))


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32 rows) as ``q4q8_linear.c`` reads it: per block of 32, ``e · round(x / e)`` with
    ``e = max |x| / 127``."""
    blocks = x.float().reshape(*x.shape[:-1], -1, GROUP)
    amax = blocks.abs().amax(-1, keepdim=True)
    # a tensor over a tensor: a Python number over one is its reciprocal times the number in torch,
    # a last bit off the kernel's division, which moves a tie of the rounding now and then
    inverse = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse).clamp(-127, 127) * (amax / 127)).reshape(x.shape)


def int16_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32 rows) as ``q4q8_linear.c``'s ``q4q16_linear`` reads it: per block of 32, with
    ``u = x · 127 / max |x|``, ``hi = round(u)`` and ``lo = round((u - hi) · 254)`` (each in
    -127..127), ``e · (254 · hi + lo)`` with ``e = max |x| / (127 · 254)``."""
    blocks = x.float().reshape(*x.shape[:-1], -1, GROUP)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    u = blocks * inverse
    hi = torch.round(u).clamp(-127, 127)
    lo = torch.round((u - hi) * 254).clamp(-127, 127)
    return ((254 * hi + lo) * (amax / (127 * 254))).reshape(x.shape)


#: what each input format's kernel reads of fp32 rows (fp32: the rows themselves)
ROUNDED = {torch.int8: int8_rounded, torch.int16: int16_rounded}


class Q4Linear(torch.nn.Module):
    """``y = x Wᵀ + b`` on the CPU with ``W`` in int4 groups of 32, the inputs read as ``inputs``
    (``int8`` or ``float32``, :func:`pack`'s layouts); fp32 inputs and outputs (an input of another
    dtype is converted, and the output back)."""

    def __init__(self, weights: Int4Weights, bias: torch.Tensor | None, cache: Path | None,
                 inputs: torch.dtype | None = None) -> None:  # fmt: skip
        super().__init__()
        n, k = weights.shape
        inputs = q4_inputs() if inputs is None else inputs
        if not q4_kernel() or not q4_fits(n, k) or inputs not in KERNELS:
            raise UnsupportedQuantization(f"the int4 kernels do not take a [{n}, {k}] weight with {inputs} inputs on this CPU")
        try:
            library(cache)
        except KernelUnavailable as error:
            raise UnsupportedQuantization(str(error)) from error
        self.out_features, self.in_features = n, k
        self.inputs = inputs
        nibbles, scales = pack(weights, inputs)
        self.register_buffer("nibbles", nibbles)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        check_rows_alone(self, weights.dequantize, ROUNDED.get(inputs))

    @property
    def dtype(self) -> torch.dtype:
        """The inputs' format (fused layers group by it)."""
        return self.inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the operator keeps the layer inside the graph
            y = _q4_linear(x.reshape(-1, self.in_features), self.nibbles, self.scales, INPUT_CODES[self.inputs])
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return self._eager(x)

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        """The forward calling the kernel directly, with what it reads of the layer kept outside the
        module's buffers: the decoder's four calls a layer, about 120 a step, each cost 9 µs
        beside the kernel through an operator and the buffers' lookups, about 3 µs so."""
        call = self.__dict__.get("_call")
        if call is None:
            call = self.__dict__["_call"] = (self.nibbles, self.scales, self.bias, self.nibbles.data_ptr(),
                                             self.scales.data_ptr(), KERNELS[self.inputs])  # fmt: skip
        nibbles, scales, bias, nibbles_at, scales_at, kernel = call
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous() or flat.device.type != "cpu":
            y = _product(flat, nibbles, scales, INPUT_CODES[self.inputs])
        else:
            y = torch.empty(flat.shape[0], self.out_features)
            if flat.shape[0]:
                status = getattr(loaded(), kernel)(flat.data_ptr(), nibbles_at, scales_at, y.data_ptr(), flat.shape[0],
                                                   self.out_features, self.in_features, threads())  # fmt: skip
                if status:
                    raise MemoryError(f"{kernel} failed with status {status}")
        if bias is not None:
            y += bias
        if y.dim() != x.dim():
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def forget_tensors(self) -> None:
        """Drop the kernel call kept with this layer's tensors (they were replaced: moved, converted,
        or made views of a fused layer's; kept, the old ones stayed in memory, 45 MiB on the default model)."""
        self.__dict__.pop("_call", None)

    def _apply(self, fn, recurse=True):  # a moved or converted buffer: point at the new one
        self.forget_tensors()
        return super()._apply(fn, recurse)

    @classmethod
    def fused_from(cls, parts: list[Q4Linear]) -> tuple[Q4Linear, list[str]]:
        """One layer computing the ``parts``' outputs side by side (their panels one after another:
        the columns are independent, so the bits are the parts'), and the names of the buffers the
        parts may share with it."""
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused.in_features, fused.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        fused.inputs = parts[0].inputs
        for name in ("nibbles", "scales"):
            fused.register_buffer(name, torch.cat([getattr(p, name) for p in parts]))
        biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
        fused.register_buffer("bias", None if all(p.bias is None for p in parts) else torch.cat(biases))
        return fused, ["nibbles", "scales"]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 g{GROUP}, "
                f"{str(self.inputs).removeprefix('torch.')} inputs ({SOURCES[self.inputs]})")  # fmt: skip


def _product(flat: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, inputs: int) -> torch.Tensor:
    """``flat`` ``[M, K]`` times the weight's transpose, ``[M, N]`` fp32, through the kernel of the
    input format whose code is ``inputs`` (:data:`INPUT_CODES`; ``nibbles`` in its layout: :func:`pack`)."""
    fmt = _FORMATS[inputs]
    n, k = nibbles.shape[0] * PANEL, nibbles.shape[1] * (8 if fmt in INTEGER_INPUTS else 2)
    if flat.device.type != "cpu" or flat.shape[-1] != k:
        raise ValueError(f"the int4 kernels take [M, {k}] CPU rows, got {list(flat.shape)} on {flat.device}")
    flat = flat.float().contiguous()
    out = torch.empty(flat.shape[0], n)
    if flat.shape[0]:
        kernels = loaded()
        assert kernels is not None, "a Q4Linear loads the kernels before its first product"
        kernel = getattr(kernels, KERNELS[fmt])
        status = kernel(flat.data_ptr(), nibbles.data_ptr(), scales.data_ptr(), out.data_ptr(), flat.shape[0], n, k,
                        threads())  # fmt: skip
        if status:
            raise MemoryError(f"an int4 kernel failed ({status}: -1 a buffer, -2 no kernel in this build, -3 a shape)")
    return out


_q4_linear = operator("q4_linear(Tensor flat, Tensor nibbles, Tensor scales, int inputs) -> Tensor", _product,
                      lambda flat, nibbles, scales, inputs: flat.new_empty((flat.shape[0], nibbles.shape[0] * PANEL)))
