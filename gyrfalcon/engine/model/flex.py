"""Attention that reads the KV blocks in place: torch's flex attention over the whole cache.

The ``gather`` attention (:func:`~gyrfalcon.engine.model.attention.paged_attention`'s default) copies
each sequence's blocks into a dense ``[b, KVH, L, D]`` tensor every layer and step, then runs SDPA
with a bool mask. This one copies nothing: the keys and values of a layer are the cache itself,
viewed as one sequence of ``num_blocks * block_size`` slots, and a :class:`BlockMask` built from the
block tables says which slots each query row reads —

- its sparse part lists, per row, the physical blocks of the row's table (flex's kernels visit
  only those: the KV traffic is the row's own context);
- its ``mask_mod`` is complete on its own (flex's unfused implementation, the CPU's without
  ``torch.compile``, evaluates it over every slot): a slot is visible when its block is in the
  row's table at logical index ``j`` and ``j * block_size + offset`` is at most the row's position
  (and inside the layer's sliding window).

Decode rows form one batch (``[B, H, 1, D]`` queries, the cache broadcast over the batch without a
copy); each prefill chunk is one call (``[1, H, c, D]``). The widths of every tensor depend only on
the batch and the cache, never on the context length, so one captured graph per batch bucket
serves every context. On CUDA the kernel is ``torch.compile(flex_attention)``; elsewhere the
unfused implementation runs (exact, for tests; the CPU serves ``gather``).
"""

from __future__ import annotations

import warnings

import torch

#: ``--attention-backend`` choices: auto is flex on CUDA, gather elsewhere
BACKENDS = ("auto", "flex", "gather")
#: the query block of the block masks (flex's default tile)
Q_BLOCK = 128

_compiled = None


def resolve(backend: str, device: torch.device) -> str:
    """The backend that ``--attention-backend backend`` runs on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "gather"
    return backend


def _kernel(device: torch.device):
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return _unfused
    if _compiled is None:
        _compiled = torch.compile(flex_attention, fullgraph=True)
    return _compiled


def _unfused(*args, **kwargs):
    """Flex attention's unfused implementation, without its warning that it is unfused (chosen:
    exact and compile-free, where the serving path is gather)."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():  # inside a compiled step: flex is compiled with it
        return flex_attention(*args, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


def _logical(tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[R, num_blocks]``: the logical index of each physical block in each row's table, or a value
    past every table where the row does not hold it. A block a table names twice (the scratch block
    that pads tables) takes its first index, deterministically (``amin``)."""
    rows, width = tables.shape
    past = torch.full((rows, num_blocks), width + num_blocks, dtype=torch.int32, device=tables.device)
    index = torch.arange(width, dtype=torch.int32, device=tables.device).expand(rows, width)
    return past.scatter_reduce_(1, tables, index, reduce="amin")


def mask_bytes_per_block(rows: int, queries: int) -> int:
    """The bytes a :func:`block_mask` of ``rows`` rows of ``queries`` queries keeps per block of the
    cache (its block indices and each row's logical index span every block: the KV cache's sizing
    counts them, :mod:`~gyrfalcon.engine.model.budget`)."""
    return 4 * rows * (1 + -(-queries // Q_BLOCK))


def block_mask(cache, tables: torch.Tensor, positions: torch.Tensor, queries: int, window: int | None):
    """The :class:`BlockMask` of ``R`` rows over ``cache``'s slots: row ``r`` holds the blocks
    ``tables[r]`` (``[R, nb]``); its query ``i`` (of ``queries``) sits at position
    ``positions[r] + i`` and sees the positions up to its own (and inside ``window``)."""
    from torch.nn.attention.flex_attention import BlockMask

    bs, num_blocks = cache.block_size, cache.num_blocks
    rows, width = tables.shape
    logical = _logical(tables, num_blocks)
    last = positions + (queries - 1)  # the last query's position: blocks past it are never read
    counts = torch.clamp(torch.div(last, bs, rounding_mode="floor") + 1, max=width).to(torch.int32)
    q_blocks = -(-queries // Q_BLOCK)
    indices = torch.zeros((rows, 1, q_blocks, num_blocks), dtype=torch.int32, device=tables.device)
    indices[..., :width] = tables.to(torch.int32)[:, None, None, :]
    counts = counts[:, None, None].expand(rows, 1, q_blocks).contiguous()

    def mask_mod(b, h, q, kv):
        seen = logical[b, kv // bs] * bs + kv % bs  # the slot's position in row b (past the row: huge)
        visible = seen <= positions[b] + q
        if window is not None:
            visible &= seen > positions[b] + q - window
        return visible

    # no q-block index: it serves only the backward pass, and would sort every block of the cache
    return BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=(Q_BLOCK, bs), mask_mod=mask_mod,
                                    seq_lengths=(queries, num_blocks * bs), compute_q_blocks=False)  # fmt: skip


def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask, scaling: float | None) -> torch.Tensor:
    """``query`` ``[R, H, q, D]`` over the layer's whole cache (``[slots, KVH, D]``, read in place)
    through ``mask``; returns ``[R, q, H, D]``."""
    rows = query.shape[0]
    k = k_cache.permute(1, 0, 2).unsqueeze(0).expand(rows, -1, -1, -1)
    v = v_cache.permute(1, 0, 2).unsqueeze(0).expand(rows, -1, -1, -1)
    kwargs = {}
    if query.device.type == "cuda":
        # the kernel's key tile must fit in one KV block (its sparse unit); flex's decoding kernel
        # is not asked for: it tiles keys by its own block size
        kwargs["kernel_options"] = {"BLOCK_N": min(mask.BLOCK_SIZE[1], 64), "FORCE_USE_FLEX_ATTENTION": True}
    out = _kernel(query.device)(query, k, v, block_mask=mask, scale=scaling, enable_gqa=k.shape[1] != query.shape[1],
                                **kwargs)  # fmt: skip
    return out.transpose(1, 2)
