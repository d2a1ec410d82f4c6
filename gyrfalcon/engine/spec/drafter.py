"""Which decoding sequences speculate in a step, and their draft tokens (``--speculative-config``):
n-gram look-ups (:mod:`~gyrfalcon.engine.spec.ngram`) or a draft model's greedy tokens
(:mod:`~gyrfalcon.engine.spec.draft_model`).

A sequence decoding alone in its row may feed its draft tokens beside its last token: each draft
is one more single-token row of the same sequence, at the next position, so the step computes
every row exactly as the decode steps it replaces would (rows are computed alike at any batch
size, and a row's attention reads its sequence's KV up to its own position). The batcher then
draws the rows in turn (:meth:`gyrfalcon.engine.batcher.Batcher.step`): a draft is kept while the
token drawn before it equals it, so every token is the one the model's own step would have drawn,
greedy or seeded, its logprobs included.

Only a sequence decoding alone speculates (:data:`MAX_SEQUENCES`): on a CPU a step's rows are not
free (on the default model a step of five rows takes 1.65 times one of one row), and beside a
second sequence the drafts cost more than they save (measured with two at a time: 0.89-0.92x). For the same reason a sequence drafts only as deep as its drafts have lately
been kept: one token more than its last draft kept, or one more than a draft kept whole, up to
``num_speculative_tokens``.
"""

from __future__ import annotations

from typing import Any

from gyrfalcon.engine.spec.ngram import NgramIndex
from gyrfalcon.engine_api.config import SpeculativeConfig

#: most decoding sequences a step may hold and still speculate
MAX_SEQUENCES = 1


class Drafter:
    """Draft tokens for sequences (``config``'s method and counts), with what it has counted."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        #: ``draft_model``'s proposer, once loaded (``TransformersEngine._load``); None: n-grams
        self.draft: Any = None
        self._indexes: dict[Any, NgramIndex] = {}
        self._depths: dict[Any, int] = {}  # how deep each sequence drafts next
        #: vLLM's counters: drafts proposed, draft tokens, accepted ones, and accepted per position
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens

    def propose(self, seq: Any) -> list[int]:
        """Up to ``num_speculative_tokens`` draft tokens to follow ``seq``'s tokens, within its
        ``max_tokens`` and the context (the last row's token is drawn whatever the drafts)."""
        params = seq.stopper.params
        room = min(params.max_tokens - len(seq.token_ids), self.max_model_len - seq.num_tokens) - 1
        k = min(self._depths.get(seq, self.config.num_speculative_tokens), room)
        if k <= 0:
            return []
        if self.draft is not None:
            return self.draft.propose(seq, seq.tokens(0, seq.num_tokens), k)
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        index.extend(seq.tokens(len(index.tokens), seq.num_tokens))
        return index.propose(k)

    def verified(self, seq: Any, proposed: int, accepted: int) -> None:
        """``seq``'s draft of ``proposed`` tokens, of which the first ``accepted`` were kept."""
        self._depths[seq] = min(self.config.num_speculative_tokens, accepted + 1)
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def forget(self, seq: Any) -> None:
        """``seq``'s KV was released (finished, aborted, preempted): its index goes."""
        self._indexes.pop(seq, None)
        self._depths.pop(seq, None)
        if self.draft is not None:
            self.draft.forget(seq)

    def stats(self) -> dict[str, Any]:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position)}  # fmt: skip
