"""Built-in sampling policies beyond temperature and truncation, with vLLM's semantics.

Every policy is a batch-shaped :class:`~gyrfalcon.policies.LogitsProcessor` that changes only the
rows asking for it. Per-row values are written once per sequence into per-slot device tensors when
it joins the persistent batch (``add_row``) and gathered by slot in a step (one vectorised pass per
policy); generated-token counts are the engine's (``BatchRows.output_counts``):

- ``allowed_token_ids``: every other token is masked;
- ``bad_words``: a word's token sequence is banned by masking its last token wherever the tokens
  generated so far end with the rest of the sequence (single-token words are always banned). Each
  word is tokenised as it is and with one leading space, as vLLM does, so it is banned at the start
  of the text and in the middle of it;
- ``logit_bias``: per-token additive biases (clamped to [-100, 100]);
- ``repetition_penalty`` over prompt and generated tokens (positive logits divided, negative ones
  multiplied), then ``frequency_penalty`` (times each token's count) and ``presence_penalty``
  (once per token present), both over generated tokens only.

All run before temperature (``order`` < 100) and also apply to greedy rows. Torch is imported only
when a processor runs, so a torch-free frontend can load this module to read the declarations.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

from gyrfalcon.engine_api.types import EngineInfo, SamplingParams
from gyrfalcon.errors import RequestError
from gyrfalcon.policies import (
    BatchRows,
    LogitsProcessor,
    NewRow,
    SlotTensor,
    to_device,
    put_rows,
    row_index,
    take_rows,
)
from gyrfalcon.engine_api.limits import field_range

if TYPE_CHECKING:  # pragma: no cover
    import torch

MAX_LOGIT_BIAS = 100.0


class _Penalty(LogitsProcessor):
    field_name = ""
    neutral = 0.0
    uses_output_counts = True

    def __init__(self) -> None:
        self.fields = frozenset({self.field_name})
        self.values = SlotTensor((), "float32")

    def add_row(self, slot: int, row: NewRow) -> None:
        self.values.put(slot, self.clamp(float(getattr(row.params, self.field_name))), row.device)

    def clamp(self, value: float) -> float:
        """The value used: validated already, clamped again so nothing that slipped past overflows."""
        return value

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return getattr(params, self.field_name) != self.neutral

    def counts(self, rows: BatchRows, slots: torch.Tensor) -> torch.Tensor:
        """``[k, V]`` generated-token counts of the rows at ``slots``."""
        assert rows.output_counts is not None, "the engine keeps output counts for uses_output_counts processors"
        return rows.output_counts.index_select(0, slots)


class RepetitionPenaltyProcessor(_Penalty):
    """Divides positive (multiplies negative) logits of every token seen in the prompt or output."""

    name = "repetition_penalty"
    field_name = "repetition_penalty"
    neutral = 1.0
    order = 40

    def __init__(self) -> None:
        super().__init__()
        self.in_prompt = SlotTensor(None, "bool", False)

    def clamp(self, value: float) -> float:
        bounds = field_range(self.field_name)
        return min(max(value, bounds.low), bounds.high)

    def add_row(self, slot: int, row: NewRow) -> None:
        super().add_row(slot, row)
        seen = self.in_prompt.row(slot, row.device, row.vocab_size)
        seen.zero_()
        if row.prompt_token_ids:
            seen[to_device(row.prompt_token_ids, row.device)] = True

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        import torch

        index = row_index(selected, logits)
        slots = rows.slots_of(selected, index)
        seen = self.in_prompt.take(slots) | (self.counts(rows, slots) > 0)
        penalty = self.values.take(slots).unsqueeze(1)
        # Safe whatever reached here: the penalty is clamped to the validated range and the result
        # computed in fp32, with positive logits capped at the dtype's largest finite value (a
        # masked -inf logit stays -inf, NaN never appears).
        sub = take_rows(logits, index).float()
        penalised = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
        return put_rows(logits, index, penalised.clamp_max(torch.finfo(logits.dtype).max).to(logits.dtype))


class _GeneratedCountPenalty(_Penalty):
    """Subtracts ``penalty × amount(counts)`` where counts are each token's uses among the generated ones."""

    def amount(self, counts: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        index = row_index(selected, logits)
        slots = rows.slots_of(selected, index)
        penalty = self.values.take(slots).to(logits.dtype).unsqueeze(1)
        amount = self.amount(self.counts(rows, slots)).to(logits.dtype)
        return put_rows(logits, index, take_rows(logits, index) - penalty * amount)


class FrequencyPenaltyProcessor(_GeneratedCountPenalty):
    """Subtracts ``frequency_penalty × count`` of each generated token."""

    name = "frequency_penalty"
    field_name = "frequency_penalty"
    order = 41

    def amount(self, counts: torch.Tensor) -> torch.Tensor:
        return counts


class PresencePenaltyProcessor(_GeneratedCountPenalty):
    """Subtracts ``presence_penalty`` once from each token generated so far."""

    name = "presence_penalty"
    field_name = "presence_penalty"
    order = 42

    def amount(self, counts: torch.Tensor) -> torch.Tensor:
        return counts > 0


class LogitBiasProcessor(LogitsProcessor):
    """Adds each row's ``logit_bias[token_id]`` (clamped to [-100, 100]) to that token's logit."""

    name = "logit_bias"
    fields = frozenset({"logit_bias"})
    order = 30

    def validate(self, params: SamplingParams, extensions: dict[str, Any], info: EngineInfo) -> None:
        if any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in params.logit_bias.values()):
            raise RequestError("logit_bias values must be finite numbers", "logit_bias")

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return bool(params.logit_bias)

    def __init__(self) -> None:
        self.bias = SlotTensor(None, "float32")

    def add_row(self, slot: int, row: NewRow) -> None:
        bias = self.bias.row(slot, row.device, row.vocab_size)
        bias.zero_()
        ids = [int(token_id) for token_id in row.params.logit_bias]
        values = [max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(v))) for v in row.params.logit_bias.values()]
        bias[to_device(ids, row.device)] = to_device(values, row.device, "float32")

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        index = row_index(selected, logits)
        bias = self.bias.take(rows.slots_of(selected, index)).to(logits.dtype)
        return put_rows(logits, index, take_rows(logits, index) + bias)


class AllowedTokenIdsProcessor(LogitsProcessor):
    """Masks every token not listed in the row's ``allowed_token_ids``."""

    name = "allowed_token_ids"
    fields = frozenset({"allowed_token_ids"})
    order = 10

    def validate(self, params: SamplingParams, extensions: dict[str, Any], info: EngineInfo) -> None:
        if params.allowed_token_ids is None:
            return
        if params.min_tokens > 0:  # min_tokens bans the stop ids (and eos) for the first tokens
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(info.eos_token_ids))
            if set(params.allowed_token_ids) <= banned:
                raise RequestError(
                    f"allowed_token_ids lists only stop or end-of-sequence tokens, which min_tokens "
                    f"({params.min_tokens}) excludes from the first tokens: nothing could be generated",
                    "allowed_token_ids",
                )

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return params.allowed_token_ids is not None

    def __init__(self) -> None:
        self.keep = SlotTensor(None, "bool", False)

    def add_row(self, slot: int, row: NewRow) -> None:
        keep = self.keep.row(slot, row.device, row.vocab_size)
        keep.zero_()
        keep[to_device(row.params.allowed_token_ids, row.device)] = True

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        index = row_index(selected, logits)
        keep = self.keep.take(rows.slots_of(selected, index))
        return put_rows(logits, index, take_rows(logits, index).masked_fill(~keep, -math.inf))


class BadWordsProcessor(LogitsProcessor):
    """Bans the ``bad_words`` of each row (vLLM semantics, see the module docstring).

    The tokenizer is the served model's, loaded from ``info.model_path`` on first use; each list of
    words is tokenised once (cached).
    """

    name = "bad_words"
    fields = frozenset({"bad_words"})
    order = 20

    def __init__(self, model_path: str, tokenizer: Any = None) -> None:
        self.model_path = model_path
        self._tokenizer = tokenizer
        self.by_slot: dict[int, tuple[tuple[int, ...], ...]] = {}

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from gyrfalcon.models.loading import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer

    @functools.lru_cache(maxsize=1024)  # noqa: B019 - one processor per engine, bounded cache
    def token_sequences(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each word's token ids as is and, when it makes a distinct word token, with a leading space.

        A blank word (only white space) is banned as written: its own white-space tokens.
        """
        sequences: list[tuple[int, ...]] = []
        for word in words:
            if not word.strip():
                sequences.append(tuple(self.tokenizer.encode(word, add_special_tokens=False)))
                continue
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            sequences.append(plain)
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        return tuple(s for s in sequences if s)

    def validate(self, params: SamplingParams, extensions: dict[str, Any], info: EngineInfo) -> None:
        self.token_sequences(tuple(params.bad_words))

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return bool(params.bad_words)

    def add_row(self, slot: int, row: NewRow) -> None:
        self.by_slot[slot] = self.token_sequences(tuple(row.params.bad_words))

    def remove_row(self, slot: int) -> None:
        self.by_slot.pop(slot, None)

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        # Which words' last tokens to ban depends on the newest generated tokens: a host check per
        # selected row, against the token sequences tokenised once when the row joined.
        rows_hit, token_index = [], []
        for i in selected:
            generated = rows.output_token_ids[i]
            for sequence in self.by_slot[rows.slot_list[i]]:
                prefix = sequence[:-1]
                if not prefix or (len(generated) >= len(prefix) and tuple(generated[-len(prefix) :]) == prefix):
                    rows_hit.append(i)
                    token_index.append(sequence[-1])
        if rows_hit:
            logits[to_device(rows_hit, logits.device), to_device(token_index, logits.device)] = -math.inf
        return logits


def processors(info: EngineInfo) -> list[LogitsProcessor]:
    """The built-in penalty, bias, allow-list and bad-words processors."""
    return [
        AllowedTokenIdsProcessor(),
        BadWordsProcessor(info.model_path),
        LogitBiasProcessor(),
        RepetitionPenaltyProcessor(),
        FrequencyPenaltyProcessor(),
        PresencePenaltyProcessor(),
    ]
