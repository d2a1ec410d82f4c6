"""All KV-cache surgery of the transformers runner lives here.

A :class:`PaddedKVBatch` is a transformers ``DynamicCache`` of ``B`` rows and ``width`` columns in
which row ``i`` holds ``lengths[i]`` real positions, right-aligned (left padding). Masks and
position ids are built from these lengths, never from token ids (pad = eos in most chat models).
Rows are forked (n > 1 choices share one prefill) and filtered (finished rows leave at once); the
next runner adds merging of newly prefilled requests.
"""

from __future__ import annotations

import torch


class PaddedKVBatch:
    """A left-padded KV cache with per-row lengths."""

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

    def fork(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (row i becomes rows i*repeats .. i*repeats+repeats-1)."""
        if repeats == 1:
            return
        self.cache.batch_repeat_interleave(repeats)
        self.lengths = self.lengths.repeat_interleave(repeats)

    def select(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (in that order) and drop padding columns no row needs."""
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(index)
        self.lengths = self.lengths.index_select(0, index)
        unused = self.width - int(self.lengths.max()) if keep else 0
        if unused > 0:
            for layer in self.cache.layers:
                layer.keys = layer.keys[..., unused:, :]
                layer.values = layer.values[..., unused:, :]
