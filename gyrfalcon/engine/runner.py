"""The model runner: forward passes of a transformers causal LM over a padded KV batch."""

from __future__ import annotations

import torch

from gyrfalcon.engine.kv_cache import PaddedKVBatch


class ModelRunner:
    """Runs prefill and decode steps; knows nothing of requests, sampling or text.

    Every forward gets the 2D attention mask and explicit per-row position ids, so a row takes the
    same kernels alone and in a batch. Returned logits are fp32 ``[B, V]`` (last position only).
    """

    def __init__(self, model, device: torch.device | str) -> None:
        self.model = model
        self.device = torch.device(device)

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def prefill(self, prompt_token_ids: list[int]) -> tuple[torch.Tensor, PaddedKVBatch]:
        """Prefill one prompt (batch 1): ``([1, V]`` next-token logits, its KV batch)."""
        length = len(prompt_token_ids)
        batch = PaddedKVBatch(self._new_cache(), [0], self.device)
        input_ids = torch.tensor([prompt_token_ids], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=input_ids,
            attention_mask=torch.ones((1, length), dtype=torch.long, device=self.device),
            position_ids=torch.arange(length, device=self.device).unsqueeze(0),
            cache=batch.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        batch.advance(length)
        return out.logits[:, -1, :].float(), batch

    @torch.inference_mode()
    def decode(self, batch: PaddedKVBatch, token_ids: list[int]) -> torch.Tensor:
        """Feed one token per row and return the ``[B, V]`` logits of the next position."""
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device).unsqueeze(1)
        out = self.model(
            input_ids=input_ids,
            attention_mask=batch.attention_mask(1),
            position_ids=batch.position_ids(1),
            cache=batch.cache,
            use_cache=True,
        )
        batch.advance(1)
        return out.logits[:, -1, :].float()
