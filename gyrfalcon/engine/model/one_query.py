"""Attention on the CPU reading the KV blocks in place: a single query row's
(``one_query_attention.c`` of :mod:`~gyrfalcon.kernels.native`), and a prefill segment's groups of
rows (``prefill_attention.c``: :meth:`RowsInPlace.prefill`).

Decode rows — and a prefill's one-row groups, so that a position gets the same bits whichever way
it came — take it where :meth:`RowsInPlace.of` allows; every other row keeps the gather-then-SDPA
path of :mod:`~gyrfalcon.engine.model.attention`. Eager and compiled steps call the same kernel (a
compiled step through the operator ``gyrfalcon::one_query_attention``), so they agree to the last
bit. Measured on the default model (batch 1, a context of 128): about 14 µs a layer in the kernel
against 36 for SDPA's call alone, and no per-layer copy of the context; the compiled step went from
about 9.3 to 8.0 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyrfalcon.kernels import native

#: the widest head and the most query heads per KV head the kernel takes
MAX_DIM, MAX_GROUP = 256, 16
#: the largest block (tokens) whose groups ``prefill_attention.c`` takes
PREFILL_MAX_BLOCK = 16
#: the caches it reads, as the kernels' ``format`` codes (``vectors.h``'s ``CACHE_*``)
CACHE_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def one_query_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor,
                        positions: torch.Tensor, block_size: int, window: int, scale: float) -> torch.Tensor:  # fmt: skip
    """Each row's query ``q`` ``[b, H, D]`` attending to its context's keys and values, read in
    place from one layer's caches ``[slots, KVH, D]`` (fp32, or bf16 or fp16 widened exactly) through its
    block table ``blocks`` ``[b, nb]``: the columns up to ``positions`` ``[b]`` (and past
    ``position - window`` where ``window`` > 0). Returns ``[b, H, D]`` fp32."""
    kernels = native.loaded()
    assert kernels is not None, "the engine's kernels are loaded before a step reads in place"
    if not (q.dtype == torch.float32 and keys.dtype == values.dtype and keys.dtype in CACHE_FORMATS
            and blocks.dtype == positions.dtype == torch.long and keys.is_contiguous() and values.is_contiguous()):  # fmt: skip
        raise ValueError("one_query_attention takes fp32 queries, contiguous fp32, bf16 or fp16 caches, int64 block tables "
                         "and positions")  # fmt: skip
    q, blocks, positions = q.contiguous(), blocks.contiguous(), positions.contiguous()
    out = q.new_empty(q.shape)
    if q.shape[0]:
        status = kernels.one_query_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), blocks.data_ptr(),
                                             positions.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1], keys.shape[1],
                                             q.shape[2], blocks.shape[1], block_size, window, scale,
                                             CACHE_FORMATS[keys.dtype], native.threads())  # fmt: skip
        if status:
            raise MemoryError("one_query_attention could not allocate its scores")
    return out


_operator = native.operator("one_query_attention(Tensor q, Tensor keys, Tensor values, Tensor blocks, "
                            "Tensor positions, int block_size, int window, float scale) -> Tensor",
                            one_query_attention, lambda q, *_: q.new_empty(q.shape))  # contiguous, as the kernel's


def applies(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> bool:
    """Whether the kernel takes a layer of this shape: on the CPU with the engine's kernels
    loaded, an fp32 stream and a cache of :data:`CACHE_FORMATS`, a head width of whole 16-lane vectors up to
    :data:`MAX_DIM`, at most :data:`MAX_GROUP` query heads per KV head."""
    return (native.loaded() is not None and device.type == "cpu" and dtype == torch.float32 and cache_dtype in CACHE_FORMATS
            and dim % 16 == 0 and dim <= MAX_DIM and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP)  # fmt: skip


@dataclass(frozen=True)
class RowsInPlace:
    """One layer's single-query attention in place: ``rows(q [b, H, D], blocks [b, nb], positions [b])``
    → ``[b, 1, H, D]``."""

    keys: torch.Tensor
    values: torch.Tensor
    block_size: int
    window: int
    scale: float

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, block_size: int, window: int | None, scaling: float | None,
           dim: int) -> RowsInPlace:  # fmt: skip
        """One layer's kernel over its caches; whether it applies is decided once per runner
        (:func:`applies`, ``StepMetadata.rows_in_place``), so every step takes the same kernel."""
        scale = float(scaling if scaling is not None else dim**-0.5)
        return cls(keys, values, block_size, int(window or 0), scale)

    def __call__(self, q: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        attend = _operator if torch.compiler.is_compiling() else one_query_attention
        return attend(q, self.keys, self.values, blocks, positions, self.block_size, self.window, self.scale).unsqueeze(1)

    def prefill(self, q: torch.Tensor, blocks: torch.Tensor, start: int, out: torch.Tensor,
                groups: list[tuple[int, int]]) -> None:  # fmt: skip
        """The rows of a prefill segment at positions ``start ..`` of one sequence (``q``
        ``[T, H, D]``, its block table ``blocks`` ``[nb]``) into ``out`` ``[T, H, D]`` (contiguous),
        by ``groups``: ``(first, stop)`` positions of at most :data:`PREFILL_MAX_BLOCK` rows, two
        or more each (:func:`~gyrfalcon.engine.model.attention.block_groups` cuts them), through
        ``prefill_attention.c``; the rows of no group are left as they are.

        Why: the groups went through SDPA one call each over keys and values copied out of the
        cache and repeated to every query head, about 60 GFLOP/s on two AVX2 cores; the kernel
        reads them in place and shares each with a group's rows and heads."""
        if not (out.is_contiguous() and out.dtype == q.dtype == torch.float32 and out.shape == q.shape):
            raise ValueError("prefill attention writes fp32 rows [T, H, D] into a contiguous tensor of their shape")
        q, blocks = q.contiguous(), blocks.contiguous()
        cuts = torch.tensor(groups, dtype=torch.long).reshape(-1)
        status = native.loaded().prefill_attention(
            q.data_ptr(), self.keys.data_ptr(), self.values.data_ptr(), blocks.data_ptr(), out.data_ptr(),
            cuts.data_ptr(), len(groups), start, q.shape[1], self.keys.shape[1], q.shape[2], self.block_size,
            self.window, self.scale, CACHE_FORMATS[self.keys.dtype], native.threads())  # fmt: skip
        if status:
            raise MemoryError(f"prefill_attention failed ({status}: -1 a buffer, -2 a group or shape it does not take)")
