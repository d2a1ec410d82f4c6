"""The ceiling: a bare torch loop over the same model, prompts, dtype and thread count.

No server, no scheduler, no sampling policies: prefill every prompt in one batch (equal lengths, so
no padding), then decode greedily in one batch with transformers' ``DynamicCache``, the 2D mask and
explicit positions — what the engine does at its best, minus everything around the forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class CeilingResult:
    """One bare-loop run: ``batch`` prompts, ``new_tokens`` decoded per row."""

    batch: int
    new_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.batch * self.new_tokens / self.total_s

    @property
    def time_per_step(self) -> float:
        """Decode seconds per step (= time per output token of each row)."""
        return self.decode_s / max(self.new_tokens - 1, 1)


def load(model_path: str, dtype: str = "float32", threads: int = 1):
    """Load the model as the server does (CPU, ``dtype``, ``threads`` torch threads)."""
    import torch

    from gyrfalcon.models.loading import load_model

    torch.set_num_threads(threads)
    return load_model(model_path, dtype, "cpu")


def bare_loop(model, prompts: list[list[int]], new_tokens: int) -> CeilingResult:
    """Prefill ``prompts`` (equal lengths) in one forward, then ``new_tokens - 1`` greedy decode steps."""
    import torch
    from transformers import DynamicCache

    batch, length = len(prompts), len(prompts[0])
    assert all(len(p) == length for p in prompts), "the bare loop takes prompts of equal length"
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        start = time.perf_counter()
        out = model(
            input_ids=torch.tensor(prompts),
            attention_mask=torch.ones((batch, length), dtype=torch.long),
            position_ids=torch.arange(length).expand(batch, -1),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        token = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        prefilled = time.perf_counter()
        for step in range(1, new_tokens):
            width = length + step
            out = model(
                input_ids=token,
                attention_mask=torch.ones((batch, width), dtype=torch.long),
                position_ids=torch.full((batch, 1), width - 1),
                cache=cache,
                use_cache=True,
            )
            token = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        done = time.perf_counter()
    return CeilingResult(batch, new_tokens, prefilled - start, done - prefilled)
