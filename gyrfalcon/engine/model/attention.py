"""Attention over the KV blocks, plugged into transformers' attention-function registry.

The model runs one flat forward per step: ``input_ids`` of shape ``[1, T]`` hold every scheduled
token of every sequence (prefill chunks and decode tokens side by side), with explicit positions.
The model's own code computes projections, rotary embeddings and norms; for attention it calls the
function registered here as ``"gyrfalcon_paged"``, which

1. writes the step's new keys and values into their slots of the preallocated cache
   (:class:`gyrfalcon.engine.kv.cache.PagedKVCache`), then
2. reads, per sequence, only its own blocks (whole blocks gathered through its block table: one
   copy of contiguous block-sized chunks, never a per-token gather) and runs torch's SDPA
   (:func:`_sdpa`; transformers' ``sdpa`` function where the layer passes what only it handles):
   one batched call for the single-token segments (decode), and for a multi-token segment (a
   prefill chunk) one call per group of its query rows that shares a KV block
   (:func:`block_groups`: a row's bits then do not depend on where its prompt was cut), each with
   a mask built from positions — causal, and windowed on layers with a sliding window.

With ``StepMetadata.attention == "flex"`` step 2 copies nothing: flex attention reads the blocks in
place (:mod:`gyrfalcon.engine.model.flex`). On the CPU the single-query rows (decode rows, and a
prefill's one-row groups) read them in place too, through a C kernel of ours
(:mod:`gyrfalcon.engine.model.one_query`), where the model and cache allow it.

Transformers builds no mask for an attention function it does not know (so none is built), and
the model is given no cache object: this module owns both. The step's :class:`StepMetadata` travels
to the attention function as the keyword argument ``gyrfalcon_step`` (models forward extra keyword
arguments to their attention function).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from gyrfalcon.engine.kv.cache import PagedKVCache
from gyrfalcon.engine.model.one_query import PREFILL_MAX_BLOCK, RowsInPlace

ATTENTION_NAME = "gyrfalcon_paged"
STEP_KWARG = "gyrfalcon_step"


@dataclass
class Segment:
    """``count`` consecutive tokens of one sequence at positions ``start .. start + count - 1``,
    at flat offset ``offset`` of the step; the sequence's context then spans ``start + count``
    tokens, held by ``blocks`` (the first blocks of its table, a ``[nb]`` long tensor)."""

    offset: int
    start: int
    count: int
    blocks: torch.Tensor


@dataclass
class StepMetadata:
    """Everything the attention function needs for one forward (built by the runner).

    ``slot_mapping``: ``[T]`` cache slot of each new token. Single-token segments form the decode
    group: ``decode_rows`` (flat offsets, ``[B]``), ``decode_blocks`` (``[B, nb]`` block table of
    each row, padded with the scratch block) and ``decode_positions`` (``[B]`` position of each
    row's token; context column ``j`` holds position ``j``). Multi-token segments are ``prefills``.
    ``decode_only`` marks a step of decode rows at flat offsets ``0..B-1`` (the captured shape).
    """

    cache: PagedKVCache
    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None = None
    decode_blocks: torch.Tensor | None = None
    decode_positions: torch.Tensor | None = None
    prefills: list[Segment] = field(default_factory=list)
    decode_only: bool = False
    #: ``gather`` (copy each sequence's blocks, then SDPA) or ``flex`` (read them in place:
    #: :mod:`gyrfalcon.engine.model.flex`)
    attention: str = "gather"
    #: single-query rows read the blocks in place on the CPU (:func:`~gyrfalcon.engine.model.one_query.applies`,
    #: decided once by the runner)
    rows_in_place: bool = False
    #: the rows each LoRA adapter of the step runs with (:class:`~gyrfalcon.engine.lora.step.LoraRows`; None: none)
    lora: Any = None
    _masks: dict = field(default_factory=dict)

    def flex_mask(self, index: int | None, window: int | None):
        """The flex block mask of the decode group (``index`` None) or of prefill segment ``index``."""
        from gyrfalcon.engine.model import flex

        key = ("flex", index, window)
        mask = self._masks.get(key)
        if mask is None:
            if index is None:
                assert self.decode_blocks is not None and self.decode_positions is not None
                mask = flex.block_mask(self.cache, self.decode_blocks, self.decode_positions, 1, window)
            else:
                segment = self.prefills[index]
                # a fill on the device, not a copy from the host (the step's inputs made their one copy)
                start = torch.full((1,), segment.start, dtype=torch.long, device=segment.blocks.device)
                mask = flex.block_mask(self.cache, segment.blocks.unsqueeze(0), start, segment.count, window)
            self._masks[key] = mask
        return mask

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """``[B, 1, 1, L]``: column ``j`` is visible to its row when ``j <= position`` (and inside
        the window). Padding columns lie past the row's position, so they are never visible."""
        key = ("decode", window)
        mask = self._masks.get(key)
        if mask is None:
            assert self.decode_blocks is not None and self.decode_positions is not None
            width = self.decode_blocks.shape[1] * self.cache.block_size
            columns = torch.arange(width, device=self.decode_blocks.device)
            position = self.decode_positions.unsqueeze(1)
            mask = columns.unsqueeze(0) <= position
            if window is not None:
                mask &= columns.unsqueeze(0) > position - window
            mask = self._masks[key] = mask[:, None, None, :]
        return mask

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor:
        """``[1, 1, count, nb * block_size]`` causal (and windowed) mask of prefill segment ``index``."""
        key = (index, window)
        mask = self._masks.get(key)
        if mask is None:
            segment = self.prefills[index]
            device = segment.blocks.device
            queries = torch.arange(segment.start, segment.start + segment.count, device=device).unsqueeze(1)
            keys = torch.arange(segment.blocks.shape[0] * self.cache.block_size, device=device).unsqueeze(0)
            mask = keys <= queries
            if window is not None:
                mask &= keys > queries - window
            mask = self._masks[key] = mask[None, None]
        return mask


def _window(module: torch.nn.Module, kwargs: dict) -> int | None:
    """The layer's sliding window (None: full attention), as the model passes it or declares it."""
    window = kwargs.pop("sliding_window", None)
    if window is None:
        window = getattr(module, "sliding_window", None)
    return int(window) if window else None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: ``query`` ``[1, H, T, D]``, ``key``/``value``
    ``[1, KVH, T, D]`` of the step's new tokens; returns ``[1, T, H, D]``."""
    step: StepMetadata = kwargs.pop(STEP_KWARG)
    window = _window(module, kwargs)
    layer = module.layer_idx
    cache = step.cache
    k_cache, v_cache = cache.keys[layer], cache.values[layer]
    k_cache.index_copy_(0, step.slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(0, step.slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))
    in_place = step.attention == "flex" and k_cache.dtype == query.dtype and not _needs_sdpa(kwargs)

    # single query rows read the blocks in place on the CPU (``one_query_attention.c``)
    rows_in_place = (RowsInPlace.of(k_cache, v_cache, cache.block_size, window, scaling, query.shape[-1])
                     if step.rows_in_place and not in_place and not _needs_sdpa(kwargs) else None)  # fmt: skip
    sdpa = _layer_sdpa(module, scaling, kwargs)

    def gather(blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return _gather(k_cache, blocks, cache.block_size, dtype), _gather(v_cache, blocks, cache.block_size, dtype)

    def attend(q: torch.Tensor, blocks: torch.Tensor, index: int | None = None) -> torch.Tensor:
        # q [b, H, q, D] over blocks [b, nb]: the decode group (index None) or, in place, prefill segment index
        if in_place:
            from gyrfalcon.engine.model import flex

            return flex.attend(q, k_cache, v_cache, step.flex_mask(index, window), scaling)
        if rows_in_place is not None:
            return rows_in_place(q[:, :, 0], blocks, step.decode_positions)
        return sdpa(q, *gather(blocks, q.dtype), step.decode_mask(window))

    if step.decode_only:
        out = attend(query[0].transpose(0, 1).unsqueeze(2), step.decode_blocks)  # [B, H, 1, D] in
        return out.transpose(0, 1), None  # [1, B, H, D]

    total = query.shape[2]
    output = query.new_empty((1, total, query.shape[1], query.shape[3]))
    if step.decode_rows is not None:
        out = attend(query[0].index_select(1, step.decode_rows).transpose(0, 1).unsqueeze(2), step.decode_blocks)
        output[0].index_copy_(0, step.decode_rows, out[:, 0])
    for index, segment in enumerate(step.prefills):
        rows = slice(segment.offset, segment.offset + segment.count)
        if in_place:
            output[:, rows] = attend(query[:, :, rows], segment.blocks.unsqueeze(0), index)
        else:
            _prefill_by_groups(sdpa, query, lambda: gather(segment.blocks.unsqueeze(0), query.dtype),
                               lambda: step.prefill_mask(index, window), segment, cache.block_size, output,
                               rows_in_place)  # fmt: skip
    return output, None


def _layer_sdpa(module: torch.nn.Module, scaling: float | None, kwargs: dict):
    """``sdpa(q, k, v, mask)`` of a layer: :func:`_sdpa`, or transformers' SDPA function where the
    layer passes what only it handles (the model's other arguments go along; it refuses what it
    cannot do). Returns ``[b, q, H, D]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if _needs_sdpa(kwargs):
            out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scaling, is_causal=False, **kwargs)
            return out
        return _sdpa(q, k, v, mask, scaling)

    #: whether it takes keys and values repeated to the query heads as well (ours does)
    sdpa.takes_repeated = not _needs_sdpa(kwargs)  # type: ignore[attr-defined]
    return sdpa


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """SDPA of ``q`` ``[b, H, q, D]`` over ``k``/``v`` ``[b, KVH, L, D]`` under a boolean ``mask``;
    returns ``[b, q, H, D]``. A single query row's heads are packed onto their KV heads as rows
    (transformers' ``pack_gqa``), longer queries attend to repeated KV heads (its ``repeat_kv``;
    ``k``/``v`` may come repeated already, ``[b, H, L, D]``).

    Why not transformers' function: it packs only when not compiling, so a compiled step's
    attention took another shape than the eager step's and rounded apart from position 1 on;
    here both take the same shapes, to the last bit."""
    b, heads, rows, dim = q.shape
    groups = heads // k.shape[1]
    if groups > 1 and rows == 1:
        out = F.scaled_dot_product_attention(q.reshape(b, heads // groups, groups, dim), k, v, attn_mask=mask, scale=scaling)
        out = out.reshape(b, heads, 1, dim)
    else:
        if groups > 1 and k.shape[1] != heads:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous()


def _gather(layer_cache: torch.Tensor, blocks: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The slots of ``blocks`` ``[b, nb]`` of one layer's keys or values, as ``[b, KVH, nb * block_size, D]``
    in ``dtype`` (whole blocks copied, never a per-token gather)."""
    blocked = layer_cache.view(-1, block_size, *layer_cache.shape[1:])
    rows, width = blocks.shape[0], blocks.shape[1] * block_size
    return blocked.index_select(0, blocks.reshape(-1)).view(rows, width, *layer_cache.shape[1:]).transpose(1, 2).to(dtype)


def _prefill_by_groups(sdpa, query: torch.Tensor, keys_values: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                       mask: Callable[[], torch.Tensor], segment: Segment, block_size: int, output: torch.Tensor,
                       rows_in_place: RowsInPlace | None = None) -> None:  # fmt: skip
    """Prefill ``segment``'s rows of ``output`` by :func:`block_groups` groups. Where
    ``rows_in_place`` is given (the CPU's kernels), every group reads the blocks in place: a group
    of one row through the decode rows' kernel (the row's bits then do not depend on whether it came
    as a prefill or a decode row), the others through ``prefill_attention.c``. Otherwise one ``sdpa``
    call per group over the gathered keys and values (``keys_values()``) and ``mask()``'s columns
    up to the group's last block."""
    groups = block_groups(segment.start, segment.count, block_size)
    if rows_in_place is not None and block_size <= PREFILL_MAX_BLOCK:
        rows = slice(segment.offset, segment.offset + segment.count)
        rows_in_place.prefill(query[0, :, rows].transpose(0, 1), segment.blocks, segment.start, output[0, rows],
                              [(first, stop) for first, stop in groups if stop - first > 1])  # fmt: skip
        for first, stop in groups:
            if stop - first == 1:
                row = segment.offset + first - segment.start
                position = torch.full((1,), first, dtype=torch.long, device=query.device)
                output[:, row : row + 1] = rows_in_place(query[:, :, row], segment.blocks.unsqueeze(0), position)
        return
    (k, v), mask_columns = keys_values(), mask()
    groups = query.shape[1] // k.shape[1]
    if groups > 1 and getattr(sdpa, "takes_repeated", False):
        # repeated once for every group: each group's repeat copied its growing prefix again (a
        # 1,704-token prompt's prefill spent 1.1 of its 5.6 s copying); a group reads a slice
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    for first, stop in groups:
        rows = slice(segment.offset + first - segment.start, segment.offset + stop - segment.start)
        if rows_in_place is not None and stop - first == 1:
            position = torch.full((1,), first, dtype=torch.long, device=query.device)
            output[:, rows] = rows_in_place(query[:, :, rows.start], segment.blocks.unsqueeze(0), position)
            continue
        width = -(-stop // block_size) * block_size
        group_mask = mask_columns[..., first - segment.start : stop - segment.start, :width]
        output[:, rows] = sdpa(query[:, :, rows], k[:, :, :width], v[:, :, :width], group_mask)


def block_groups(start: int, count: int, block_size: int) -> list[tuple[int, int]]:
    """Positions ``start .. start + count`` cut at every multiple of ``block_size``: the query
    rows a prefill computes in one attention call each, with the keys up to the group's last block.

    Why: SDPA's CPU kernel groups query rows by the size of its call, and a row's last bits moved
    with that grouping, so a prompt's rows differed between a prefill of the whole prompt and one
    that starts at a cached prefix or a chunk boundary — both of which fall on block boundaries.
    Cut there, a row is computed in the same group with the same keys however its prompt is fed
    (and a group of one row takes SDPA's one-query path, a decode row's)."""
    groups, first = [], start
    while first < start + count:
        stop = min((first // block_size + 1) * block_size, start + count)
        groups.append((first, stop))
        first = stop
    return groups


def _needs_sdpa(kwargs: dict) -> bool:
    """Whether the layer asks for what only transformers' SDPA function passes on (a softcap,
    attention sinks, a position bias)."""
    return any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "sinks", "position_bias"))


def register() -> str:
    """Register :func:`paged_attention` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
