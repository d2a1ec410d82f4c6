"""The model runner: forward passes of a transformers causal LM over a padded KV batch."""

from __future__ import annotations

import torch

from gyrfalcon.engine.kv_cache import PaddedKVBatch


class ModelRunner:
    """Runs prefill chunks and decode steps; knows nothing of requests, sampling or text.

    Every forward gets the 2D attention mask built from the batch's lengths and explicit per-row
    position ids, so a row takes the same kernels alone and in a batch. The new tokens of one
    forward never contain padding: a prefill forward holds prompts of equal length only (fully
    masked query rows give NaN under SDPA). Returned logits are fp32.
    """

    def __init__(self, model, device: torch.device | str) -> None:
        from transformers.cache_utils import DynamicLayer

        self.model = model
        self.device = torch.device(device)
        self.forwards = 0  # model calls so far (tests count prefills through this)
        kinds = {type(layer) for layer in self._new_cache().layers}
        if kinds - {DynamicLayer}:
            names = ", ".join(sorted(k.__name__ for k in kinds))
            raise ValueError(f"the padded KV batch supports full-attention DynamicLayer caches only, not {names}")

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def new_batch(self, rows: int) -> PaddedKVBatch:
        """An empty KV batch of ``rows`` rows (width 0), to prefill into."""
        return PaddedKVBatch(self._new_cache(), [0] * rows, self.device)

    @torch.inference_mode()
    def forward(self, batch: PaddedKVBatch, token_ids: list[list[int]], all_logits: bool = False) -> torch.Tensor:
        """Feed ``token_ids[i]`` (equal lengths ``c``) to row ``i``; return the next-token logits.

        Returns ``[B, V]`` (the last new position of each row), or ``[B, c, V]`` with ``all_logits``
        (prompt logprobs). The cache grows by ``c`` columns and every row's length by ``c``.
        """
        new = len(token_ids[0])
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=input_ids,
            attention_mask=batch.attention_mask(new),
            position_ids=batch.position_ids(new),
            cache=batch.cache,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        )
        self.forwards += 1
        batch.advance(new)
        logits = out.logits.float()
        return logits if all_logits else logits[:, -1, :]

    def prefill(self, prompt_token_ids: list[int]) -> tuple[torch.Tensor, PaddedKVBatch]:
        """Prefill one prompt in one forward (batch 1): ``([1, V]`` next-token logits, its KV batch)."""
        batch = self.new_batch(1)
        return self.forward(batch, [list(prompt_token_ids)]), batch

    def decode(self, batch: PaddedKVBatch, token_ids: list[int]) -> torch.Tensor:
        """Feed one token per row and return the ``[B, V]`` logits of the next position."""
        return self.forward(batch, [[t] for t in token_ids])
