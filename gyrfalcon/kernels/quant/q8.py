"""A GGUF's ``Q8_0`` table served as it is: the output head in fp32 logits through a small C kernel
(``q8_linear.c`` in :mod:`~gyrfalcon.kernels.native`), and the tied input embedding looking up
the same bits. Where the kernels cannot be built the caller keeps its fp32 head
(:class:`~gyrfalcon.kernels.quant.layers.PackedLinear`) and the start-up line says why.

Measured on the default model's head (49,152 × 576; 2 threads, Sapphire Rapids), ms against the fp32
head through torch: AVX-512 1.4 / 2.3 at one row, 1.9 / 5.1 at four, 4.8 / 7.1 at sixteen, 17.0 /
17.0 at sixty-four; AVX2 1.5 / 2.5, 2.1 / 6.3, 5.4 / 10.9, 20.2 / 22.7 — a quarter of the bytes,
and at large batches the same arithmetic.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gyrfalcon.kernels.native import KernelUnavailable, library, loaded, operator, threads
from gyrfalcon.kernels.quant.layers import UnsupportedQuantization, check_rows_alone
from gyrfalcon.kernels.quant.weights import GROUP


#: rows of ``W`` per panel of the table as the kernel reads it (``P`` in ``q8_linear.c``)
PANEL = 16


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` in memory of its own: the bits are read from a memory-mapped file, and a view kept
    alive kept the whole file mapped and resident (91 MiB on the default model, for 31 of its table)."""
    return t.clone(memory_format=torch.contiguous_format)


def q8_rows(q8: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the table dequantised (``scale * q8`` per block of 32, in fp32: exact)."""
    q = q8[ids].reshape(*ids.shape, -1, GROUP).float()
    return (scale[ids].float()[..., None] * q).reshape(*ids.shape, q8.shape[1]).to(dtype)


class Q8Embedding(torch.nn.Module):
    """An input embedding kept as a GGUF's ``Q8_0`` table — ``q8`` ``[N, K]`` int8 and ``scale8``
    ``[N, K // 32]`` fp16, ``w = scale8 * q8`` per block of 32 — whose lookup dequantises only the
    rows it gathers, in the conversion's operation order: the same fp32 values as the dequantised
    table, in a quarter of its bytes (so a tied fp32 head need not keep that table for it)."""

    def __init__(self, q8: torch.Tensor, scale8: torch.Tensor, dtype: torch.dtype, padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = q8.shape
        self.dtype = dtype
        self.padding_idx = padding_idx
        self.register_buffer("q8", _own(q8))
        self.register_buffer("scale8", _own(scale8))

    @property
    def weight(self) -> torch.Tensor:
        """The whole table in ``dtype`` (for code that inspects it; the forward never builds it)."""
        return self(torch.arange(self.num_embeddings, device=self.q8.device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return q8_rows(self.q8, self.scale8, ids, self.dtype)


class Q8Linear(torch.nn.Module):
    """An fp32 ``y = x Wᵀ + b`` on the CPU over a ``Q8_0`` table — ``q8`` ``[N, K]`` int8, ``scale``
    ``[N, K // 32]`` — read by ``q8_linear.c`` in the layout it reads fastest (:func:`panels`): the
    output head beside the int4 layers. ``rows`` serves a tied input embedding from the same bits
    (:class:`~gyrfalcon.kernels.quant.layers.TiedEmbedding`)."""

    def __init__(self, q8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, cache: Path | None) -> None:
        super().__init__()
        self.out_features, self.in_features = q8.shape
        if self.in_features % GROUP:
            raise UnsupportedQuantization(f"a Q8_0 table's rows are whole blocks of {GROUP}")
        try:
            library(cache)
        except KernelUnavailable as error:
            raise UnsupportedQuantization(str(error)) from error
        q, s = panels(q8, scale.float())
        self.register_buffer("q8", q)
        self.register_buffer("scale", s)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        check_rows_alone(self, lambda: self.rows(torch.arange(self.out_features), torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        # eager calls the kernel directly (the operator's dispatch costs about 10 µs); compiled, the
        # operator keeps the head inside the graph
        product = _q8_linear if torch.compiler.is_compiling() else _product
        y = product(flat, self.q8, self.scale, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantised rows ``ids`` of ``W`` (a tied embedding's lookup), exactly."""
        panel, column = ids // PANEL, ids % PANEL
        q = self.q8[panel, :, column].reshape(*ids.shape, -1, GROUP).float()
        return (self.scale[panel, :, column][..., None] * q).reshape(*ids.shape, self.in_features).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q8_0 table, float32 logits"


def panel_shapes(n: int, k: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The shapes of :func:`panels`' table and scales for an ``[n, k]`` ``Q8_0`` table."""
    return (-(-n // PANEL), k, PANEL), (-(-n // PANEL), k // GROUP, PANEL)


def panels(q8: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``Q8_0`` table as ``q8_linear.c`` reads it: panels of :data:`PANEL` rows of ``W`` side by
    side — ``[ceil(N / 16), K, 16]`` int8 and ``[ceil(N / 16), K // 32, 16]`` fp32 scales, the last
    panel padded with zeros — in memory of their own (a view of the file kept it mapped)."""
    shapes = panel_shapes(*q8.shape)
    out = torch.empty(shapes[0], dtype=torch.int8), torch.empty(shapes[1], dtype=torch.float32)
    panels_into(q8, scale, *out)
    return out


def panels_into(q8: torch.Tensor, scale: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """:func:`panels` into ``q_out`` and ``scale_out`` (a served head's memory: a weight swap)."""
    n, k = q8.shape
    if (tuple(q_out.shape), tuple(scale_out.shape)) != panel_shapes(n, k) or scale.shape != (n, k // GROUP):
        raise ValueError(f"an [{n}, {k}] Q8_0 table packs into {panel_shapes(n, k)}")
    whole = n // PANEL
    kernels = loaded()
    if kernels is None or not (q8.device.type == "cpu" and q8.is_contiguous() and q_out.is_contiguous()) or \
            kernels.q8_pack_panels(q8.data_ptr(), q_out.data_ptr(), n, k, threads()) != 0:  # fmt: skip
        q_out[:whole].copy_(q8[: whole * PANEL].reshape(whole, PANEL, k).transpose(1, 2))
        if whole < len(q_out):  # the last panel's rows, then zeros
            q_out[whole:].zero_()
            q_out[whole, :, : n - whole * PANEL].copy_(q8[whole * PANEL :].T)
    scale_out[:whole].copy_(scale[: whole * PANEL].reshape(whole, PANEL, -1).transpose(1, 2))
    if whole < len(q_out):
        scale_out[whole:].zero_()
        scale_out[whole, :, : n - whole * PANEL].copy_(scale[whole * PANEL :].T)


def _product(flat: torch.Tensor, q8: torch.Tensor, scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """``flat`` ``[M, K]`` times the table's transpose (the table in :func:`panels`), ``[M, N]`` fp32."""
    if flat.device.type != "cpu" or flat.shape[-1] != q8.shape[1]:
        raise ValueError(f"q8_linear takes [M, {q8.shape[1]}] CPU rows, got {list(flat.shape)} on {flat.device}")
    flat = flat.float().contiguous()  # the kernel reads raw fp32 rows (a no-op for the layer's own calls)
    out = torch.empty(flat.shape[0], out_features)
    if flat.shape[0]:
        kernels = loaded()
        assert kernels is not None, "a Q8Linear loads the kernels before its first product"
        status = kernels.q8_linear(flat.data_ptr(), q8.data_ptr(), scale.data_ptr(), out.data_ptr(),
                                   flat.shape[0], out_features, q8.shape[1], threads())  # fmt: skip
        if status:
            raise MemoryError("q8_linear could not allocate its per-thread buffer")
    return out


_q8_linear = operator("q8_linear(Tensor flat, Tensor q8, Tensor scale, SymInt out_features) -> Tensor", _product,
                      lambda flat, q8, scale, out_features: flat.new_empty((flat.shape[0], out_features)))
