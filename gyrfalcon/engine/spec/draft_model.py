"""Draft tokens from a smaller model (vLLM's ``draft_model`` method): its greedy continuation.

The draft model is a local folder with the served model's tokenizer (its vocabulary is compared at
start-up: a mismatch fails the load), run as a plain transformers model in fp32 on the served
model's device. Each speculating sequence keeps the draft's own KV cache (transformers'
``DynamicCache``) and the tokens it holds: a proposal crops the cache back to what the sequence
still shares with it (a rejected draft's tokens go), feeds the tokens the sequence gained since,
then draws ``k`` greedy tokens one forward at a time. Only sequences that speculate keep a cache
(on a CPU one at a time, :data:`~gyrfalcon.engine.spec.drafter.MAX_SEQUENCES`), handed back with
the sequence. What the draft proposes changes no answer: the served model verifies every token.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class _Held:
    """One sequence's draft cache: the tokens it holds, the first of them a proposal may have made."""

    cache: Any
    tokens: list[int] = field(default_factory=list)
    drafted_from: int = 0


class DraftModel:
    """A smaller model proposing each sequence's next tokens (see the module docstring)."""

    def __init__(self, model: Any, device: str) -> None:
        self.model = model
        self.device = device
        #: the longest sequence the draft reads (beyond it, no proposal)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self._held: dict[Hashable, _Held] = {}

    @classmethod
    def load(cls, path: str, served_path: str, device: str, cache_dir: str | None = None) -> DraftModel:
        """The draft model of ``path`` beside the model served from ``served_path``; a ValueError when
        their tokenizers' vocabularies differ (a draft token would mean another text)."""
        from gyrfalcon.models.default import resolve_model
        from gyrfalcon.models.loading import load_model, load_tokenizer

        folder = resolve_model(path, cache_dir)
        draft, served = load_tokenizer(folder).get_vocab(), load_tokenizer(served_path).get_vocab()
        if draft != served:
            different = sorted(set(draft.items()) ^ set(served.items()))[:1]
            raise ValueError(f"--speculative-config: the draft model's tokenizer is not the served model's "
                             f"({len(draft)} tokens against {len(served)}; first difference {different})")  # fmt: skip
        return cls(load_model(folder, "float32", device), device)

    @torch.inference_mode()
    def propose(self, key: Hashable, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` greedy tokens to follow ``tokens`` (the sequence ``key``'s, prompt first)."""
        if k <= 0 or len(tokens) + k > self.max_positions:
            return []
        held = self._held.get(key)
        if held is None:
            from transformers import DynamicCache

            held = self._held[key] = _Held(DynamicCache(config=self.model.config))
        shared = held.drafted_from  # what came before the last proposal is the sequence's own
        limit = min(len(held.tokens), len(tokens))
        while shared < limit and held.tokens[shared] == tokens[shared]:
            shared += 1
        shared = min(shared, len(tokens) - 1)  # at least one token fed: its logits propose
        if shared < len(held.tokens):
            held.cache.crop(shared - len(held.tokens))  # (a negative count: the tokens dropped)
            del held.tokens[shared:]
        logits = self._feed(held, tokens[shared:])
        held.drafted_from = len(tokens)
        drafts: list[int] = []
        for i in range(k):
            drafts.append(int(logits.argmax()))
            if i < k - 1:
                logits = self._feed(held, drafts[-1:])
        return drafts

    def _feed(self, held: _Held, tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens`` through the draft after what its cache holds; the last one's logits."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, past_key_values=held.cache, use_cache=True, logits_to_keep=1)
        held.tokens.extend(tokens)
        return out.logits[0, -1]

    def forget(self, key: Hashable) -> None:
        """The sequence ``key`` ended or was preempted: its cache goes."""
        self._held.pop(key, None)
