"""Attention over the KV blocks, plugged into transformers' attention-function registry.

The model runs one flat forward per step: ``input_ids`` of shape ``[1, T]`` hold every scheduled
token of every sequence (prefill chunks and decode tokens side by side), with explicit positions.
The model's own code computes projections, rotary embeddings and norms; for attention it calls the
function registered here as ``"gyrfalcon_paged"``, which

1. writes the step's new keys and values into their slots of the preallocated cache
   (:class:`gyrfalcon.engine.kv.cache.PagedKVCache`), then
2. reads, per sequence, only its own blocks (whole blocks gathered through its block table: one
   copy of contiguous block-sized chunks, never a per-token gather) and runs SDPA (transformers' ``sdpa`` function, so GQA and kernel choice are the library's):
   one batched call for the single-token segments (decode), one call per multi-token segment
   (a prefill chunk), each with a mask built from positions — causal, and windowed on layers
   with a sliding window.

With ``StepMetadata.attention == "flex"`` step 2 copies nothing: flex attention reads the blocks in
place (:mod:`gyrfalcon.engine.model.flex`).

Transformers builds no mask for an attention function it does not know (so none is built), and
the model is given no cache object: this module owns both. The step's :class:`StepMetadata` travels
to the attention function as the keyword argument ``gyrfalcon_step`` (models forward extra keyword
arguments to their attention function).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gyrfalcon.engine.kv.cache import PagedKVCache

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
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    step: StepMetadata = kwargs.pop(STEP_KWARG)
    window = _window(module, kwargs)
    layer = module.layer_idx
    cache = step.cache
    k_cache, v_cache = cache.keys[layer], cache.values[layer]
    k_cache.index_copy_(0, step.slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(0, step.slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))
    blocked = (cache.num_blocks, cache.block_size, *k_cache.shape[1:])

    in_place = step.attention == "flex" and k_cache.dtype == query.dtype and not _needs_sdpa(kwargs)

    def attend(q: torch.Tensor, blocks: torch.Tensor, mask: torch.Tensor, index: int | None = None) -> torch.Tensor:
        # q: [b, H, q, D]; blocks: [b, nb] -> keys/values [b, KVH, nb * block_size, D]
        if in_place:
            from gyrfalcon.engine.model import flex

            return flex.attend(q, k_cache, v_cache, step.flex_mask(index, window), scaling)
        rows, width = blocks.shape[0], blocks.shape[1] * cache.block_size
        k = k_cache.view(blocked).index_select(0, blocks.reshape(-1)).view(rows, width, *blocked[2:])
        v = v_cache.view(blocked).index_select(0, blocks.reshape(-1)).view(rows, width, *blocked[2:])
        k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
        # the model's other attention arguments go along (sdpa refuses what it cannot do, e.g. softcap)
        out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scaling, is_causal=False, **kwargs)
        return out  # [b, q, H, D]

    if step.decode_only:
        q = query[0].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        out = attend(q, step.decode_blocks, None if in_place else step.decode_mask(window))
        return out.transpose(0, 1), None  # [1, B, H, D]

    total = query.shape[2]
    output = query.new_empty((1, total, query.shape[1], query.shape[3]))
    if step.decode_rows is not None:
        q = query[0].index_select(1, step.decode_rows).transpose(0, 1).unsqueeze(2)
        out = attend(q, step.decode_blocks, None if in_place else step.decode_mask(window))
        output[0].index_copy_(0, step.decode_rows, out[:, 0])
    for index, segment in enumerate(step.prefills):
        q = query[:, :, segment.offset : segment.offset + segment.count]
        out = attend(q, segment.blocks.unsqueeze(0), None if in_place else step.prefill_mask(index, window), index)
        output[:, segment.offset : segment.offset + segment.count] = out
    return output, None


def _needs_sdpa(kwargs: dict) -> bool:
    """Whether the layer asks for what only the SDPA path passes on (a softcap, attention sinks)."""
    return any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "sinks"))


def register() -> str:
    """Register :func:`paged_attention` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
