"""All KV-cache surgery of the transformers runner lives here.

A :class:`PaddedKVBatch` is a transformers ``DynamicCache`` of ``B`` rows and ``width`` columns in
which row ``i`` holds ``lengths[i]`` real positions, right-aligned (left padding). Masks and
position ids are built from these lengths, never from token ids (pad = eos in most chat models).

The operations continuous batching needs:

- :meth:`PaddedKVBatch.select` keeps some rows (finished rows leave at once; repeating a row
  forks it, so the ``n`` children of a request share one prefill) and drops padding no row needs;
- :meth:`PaddedKVBatch.merge` appends another batch's rows (newly prefilled requests), left-padding
  whichever side is narrower so every row stays right-aligned.

Padding columns hold zeros and are always masked, so a row's logits do not depend on its company
(the golden test checks this within 1e-5 in fp32). Only full-attention ``DynamicLayer`` caches are
supported; sliding-window and linear-attention layers would need their own surgery.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PaddedKVBatch:
    """A left-padded KV cache with per-row lengths.

    ``cache`` is the transformers cache handed to the model as ``cache=``; ``lengths`` a ``[B]``
    long tensor of real positions per row. A fresh batch (no forward yet) has width 0.
    """

    def __init__(self, cache, lengths: list[int], device: torch.device | str) -> None:
        self.cache = cache
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=device)
        self.device = device

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def width(self) -> int:
        return int(self.cache.get_seq_length())

    def padded_tokens(self) -> int:
        """``rows × width``: the cache positions this batch occupies, padding included."""
        return self.rows * self.width

    def attention_mask(self, new_tokens: int = 1) -> torch.Tensor:
        """The 2D ``[B, width + new_tokens]`` mask: padding columns 0, real and new positions 1."""
        width = self.width
        columns = torch.arange(width + new_tokens, device=self.device)
        first_real = (width - self.lengths).unsqueeze(1)
        return (columns.unsqueeze(0) >= first_real).to(torch.long)

    def position_ids(self, new_tokens: int = 1) -> torch.Tensor:
        """``[B, new_tokens]`` positions of the next tokens of every row."""
        return self.lengths.unsqueeze(1) + torch.arange(new_tokens, device=self.device).unsqueeze(0)

    def advance(self, new_tokens: int = 1) -> None:
        """Record that every row received ``new_tokens`` positions (after the forward pass)."""
        self.lengths = self.lengths + new_tokens

    def _layers(self):
        return [layer for layer in self.cache.layers if layer.is_initialized and layer.keys.numel() > 0]

    def fork(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (row i becomes rows i*repeats .. i*repeats+repeats-1)."""
        if repeats != 1:
            self.select([row for row in range(self.rows) for _ in range(repeats)])

    def select(self, keep: list[int]) -> None:
        """Keep the rows ``keep`` in that order (a row listed twice is forked) and drop unused padding.

        ``keep`` may be empty: the batch then holds no rows and no tensors (memory is released).
        """
        if not keep:
            for layer in self.cache.layers:
                layer.reset()
            self.lengths = self.lengths[:0]
            return
        if keep == list(range(self.rows)):
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.lengths = self.lengths.index_select(0, index)
        unused = self.width - int(self.lengths.max())
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, index)[..., unused:, :]
            layer.values = layer.values.index_select(0, index)[..., unused:, :]

    def merge(self, other: PaddedKVBatch) -> None:
        """Append ``other``'s rows after this batch's rows; ``other`` must not be used afterwards.

        The narrower side is left-padded with zero columns (masked by :meth:`attention_mask`), so
        every row stays right-aligned and keeps its own positions. When it raises (an OOM), this
        batch is left as it was (the layers merged so far are cut back to views of their old rows,
        so the rollback itself allocates nothing) and the running requests can go on.
        """
        if other.rows == 0:
            return
        if self.rows == 0:
            self.cache, self.lengths = other.cache, other.lengths
            return
        width, other_width = self.width, other.width
        target = max(width, other_width)
        mine, theirs = self._layers(), other._layers()
        if len(mine) != len(theirs):
            raise ValueError("cannot merge caches with different layer counts")
        rows, merged = self.rows, []
        try:
            for a, b in zip(mine, theirs):
                keys = torch.cat([_pad_left(a.keys, target - width), _pad_left(b.keys, target - other_width)], dim=0)
                values = torch.cat([_pad_left(a.values, target - width), _pad_left(b.values, target - other_width)],
                                   dim=0)  # fmt: skip
                a.keys, a.values = keys, values
                merged.append(a)
            lengths = torch.cat([self.lengths, other.lengths])
        except BaseException:
            for a in merged:
                a.keys = a.keys[:rows, :, target - width :, :]
                a.values = a.values[:rows, :, target - width :, :]
            raise
        self.lengths = lengths


def _pad_left(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    """Zero columns before the sequence dimension (``[B, H, S, D]`` → ``[B, H, columns + S, D]``)."""
    return F.pad(tensor, (0, 0, columns, 0)) if columns > 0 else tensor
