"""int4 weights in groups of 32 (a GGUF's ``Q4_1``/``Q4_0`` blocks) times fp32 inputs on the CPU,
through a C kernel of our own (``q4_linear.c`` in :mod:`~gyrfalcon.engine.model.native`).

Each output is the fp32 product with the exactly dequantised weights — the reference model's
weights — summed over the input in one fixed order (a chain of fused multiply-adds), so a row gets
the same bits alone and in any batch, on AVX2 and on AVX-512 alike, and the log-probabilities are
those of the fp32 model (torch's int4 kernel is fast only with bf16 inputs, which moved them by
0.033 nats on the default model).

Measured against torch's int4 kernel with bf16 inputs (2 threads, weights in cache; docs/kernels.md):
on AVX2, a 3072 × 576 layer takes 59 µs against 86 at one row, 320 against 698 at sixteen; on
AVX-512, 43 against 49 and 231 against 360.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gyrfalcon.engine.model.native import KernelUnavailable, library, loaded, operator
from gyrfalcon.engine.model.native.cpu import cpu
from gyrfalcon.engine.model.quant.layers import UnsupportedQuantization, check_rows_alone
from gyrfalcon.engine.model.quant.weights import GROUP, Int4Weights

#: output columns of one panel of the kernel's layout
PANEL = 16


def q4_kernel() -> bool:
    """Whether this CPU has the instructions ``q4_linear.c`` is written for (AVX2 with F16C, or AVX-512)."""
    here = cpu()
    return here.avx512 or (here.avx2 and "f16c" in here.flags)


def q4_fits(n: int, k: int) -> bool:
    """Whether an ``[n, k]`` weight has a shape the kernel takes."""
    return n % PANEL == 0 and k % GROUP == 0


def pack(weights: Int4Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """``weights`` in the kernel's layout: ``nibbles`` ``[N / 16, K / 2, 16]`` uint8 (byte ``j`` of
    pair ``t`` holds column ``16p + j``'s weights ``2t`` and ``2t + 1``, low nibble first) and
    ``scales`` ``[N / 16, K / 32, 2, 16]`` fp16 (each block's scales, then its minimums). The
    scales must be fp16 values (a GGUF's are; :meth:`Int4Weights.quantize` rounds them so)."""
    n, k = weights.shape
    q = weights.q.to(torch.uint8).reshape(n // PANEL, PANEL, k // 2, 2)
    nibbles = (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 1).contiguous()
    parts = [weights.scale, weights.minimum]
    if any(not torch.equal(p.half().float(), p.float()) for p in parts):
        raise UnsupportedQuantization("q4_linear.c takes fp16 scales and minimums")
    scales = torch.stack([p.half().reshape(n // PANEL, PANEL, k // GROUP) for p in parts], 2)
    return nibbles, scales.permute(0, 3, 2, 1).contiguous()


class Q4Linear(torch.nn.Module):
    """``y = x Wᵀ + b`` on the CPU with ``W`` in int4 groups of 32 (:func:`pack`'s layout), fp32
    inputs and outputs (an input of another dtype is converted, and the output back)."""

    def __init__(self, weights: Int4Weights, bias: torch.Tensor | None, cache: Path | None) -> None:
        super().__init__()
        n, k = weights.shape
        if not q4_kernel() or not q4_fits(n, k):
            raise UnsupportedQuantization(f"q4_linear.c does not take a [{n}, {k}] weight on this CPU")
        try:
            library(cache)
        except KernelUnavailable as error:
            raise UnsupportedQuantization(str(error)) from error
        self.out_features, self.in_features = n, k
        nibbles, scales = pack(weights)
        self.register_buffer("nibbles", nibbles)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        check_rows_alone(self, weights.dequantize())

    @property
    def dtype(self) -> torch.dtype:
        """The inputs' dtype (fused layers group by it)."""
        return torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the operator keeps the layer inside the graph
            y = _q4_linear(x.reshape(-1, self.in_features), self.nibbles, self.scales)
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
            call = self.__dict__["_call"] = (self.nibbles, self.scales, self.bias, self.nibbles.data_ptr(), self.scales.data_ptr())
        nibbles, scales, bias, nibbles_at, scales_at = call
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous() or flat.device.type != "cpu":
            y = _product(flat, nibbles, scales)
        else:
            y = torch.empty(flat.shape[0], self.out_features)
            if flat.shape[0]:
                status = loaded().q4_linear(flat.data_ptr(), nibbles_at, scales_at, y.data_ptr(), flat.shape[0],
                                            self.out_features, self.in_features, torch.get_num_threads())  # fmt: skip
                if status:
                    raise MemoryError(f"q4_linear failed with status {status}")
        if bias is not None:
            y += bias
        if y.dim() != x.dim():
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _apply(self, fn, recurse=True):  # a moved or converted buffer: point at the new one
        self.__dict__.pop("_call", None)
        return super()._apply(fn, recurse)

    @classmethod
    def fused_from(cls, parts: list[Q4Linear]) -> tuple[Q4Linear, list[str]]:
        """One layer computing the ``parts``' outputs side by side (their panels one after another:
        the columns are independent, so the bits are the parts'), and the names of the buffers the
        parts may share with it."""
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused.in_features, fused.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        for name in ("nibbles", "scales"):
            fused.register_buffer(name, torch.cat([getattr(p, name) for p in parts]))
        biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
        fused.register_buffer("bias", None if all(p.bias is None for p in parts) else torch.cat(biases))
        return fused, ["nibbles", "scales"]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 g{GROUP}, float32 (q4_linear.c)"


def _product(flat: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``flat`` ``[M, K]`` times the weight's transpose, ``[M, N]`` fp32."""
    n, k = nibbles.shape[0] * PANEL, nibbles.shape[1] * 2
    if flat.device.type != "cpu" or flat.shape[-1] != k:
        raise ValueError(f"q4_linear takes [M, {k}] CPU rows, got {list(flat.shape)} on {flat.device}")
    flat = flat.float().contiguous()
    out = torch.empty(flat.shape[0], n)
    if flat.shape[0]:
        kernels = loaded()
        assert kernels is not None, "a Q4Linear loads the kernels before its first product"
        status = kernels.q4_linear(flat.data_ptr(), nibbles.data_ptr(), scales.data_ptr(), out.data_ptr(),
                                   flat.shape[0], n, k, torch.get_num_threads())  # fmt: skip
        if status:
            raise MemoryError(f"q4_linear failed ({status}: -1 a buffer, -2 no kernel in this build, -3 a shape)")
    return out


_q4_linear = operator("q4_linear(Tensor flat, Tensor nibbles, Tensor scales) -> Tensor", _product,
                      lambda flat, nibbles, scales: flat.new_empty((flat.shape[0], nibbles.shape[0] * PANEL)))
