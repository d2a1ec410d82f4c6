"""Built-in sampling policies beyond temperature and truncation, with vLLM's semantics.

Every policy is a batch-shaped :class:`~gyrfalcon.policies.LogitsProcessor` that changes only the
rows asking for it, with per-row values gathered into tensors (one vectorised pass per policy):

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
from gyrfalcon.hookspecs import hookimpl
from gyrfalcon.policies import BatchRows, LogitsProcessor, row_index

if TYPE_CHECKING:  # pragma: no cover
    import torch

MAX_LOGIT_BIAS = 100.0

#: the smallest repetition_penalty accepted (the API spec's minimum): a smaller one would divide
#: positive logits towards overflow (1e-300 is 0.0 in fp32: inf and NaN logits)
MIN_REPETITION_PENALTY = 0.01


def _token_counts(token_lists: list[list[int]], vocab: int, logits: torch.Tensor) -> torch.Tensor:
    """``[len(token_lists), vocab]`` occurrence counts (one vectorised scatter)."""
    import torch

    width = max((len(ids) for ids in token_lists), default=0)
    counts = torch.zeros((len(token_lists), vocab + 1), dtype=logits.dtype, device=logits.device)
    if width:
        padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
        for row, ids in enumerate(token_lists):
            if ids:
                padded[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        padded = padded.to(logits.device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=logits.dtype))
    return counts[:, :vocab]


def _column(values: list[float], logits: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.tensor(values, dtype=logits.dtype, device=logits.device).unsqueeze(1)


class _Penalty(LogitsProcessor):
    field_name = ""
    neutral = 0.0
    low, high = -2.0, 2.0
    low_open = False

    def __init__(self) -> None:
        self.fields = frozenset({self.field_name})

    def validate(self, params: SamplingParams, extensions: dict[str, Any], info: EngineInfo) -> None:
        value = getattr(params, self.field_name)
        low_ok = value > self.low if self.low_open else value >= self.low
        if not (isinstance(value, (int, float)) and math.isfinite(value) and low_ok and value <= self.high):
            bracket = "(" if self.low_open else "["
            raise RequestError(f"{self.field_name} must be in {bracket}{self.low:g}, {self.high:g}]", self.field_name)

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return getattr(params, self.field_name) != self.neutral


class RepetitionPenaltyProcessor(_Penalty):
    """Divides positive (multiplies negative) logits of every token seen in the prompt or output."""

    name = "repetition_penalty"
    field_name = "repetition_penalty"
    neutral = 1.0
    low, high = MIN_REPETITION_PENALTY, 2.0
    order = 40

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        import torch

        index = row_index(selected, logits)
        vocab = logits.shape[-1]
        seen = _token_counts([rows.prompt_token_ids[i] + rows.output_token_ids[i] for i in selected], vocab, logits) > 0
        # Safe whatever reached here: the penalty is clamped to the validated range and the result
        # computed in fp32, with positive logits capped at the dtype's largest finite value (a
        # masked -inf logit stays -inf, NaN never appears).
        values = [min(max(float(rows.params[i].repetition_penalty), MIN_REPETITION_PENALTY), self.high)
                  for i in selected]  # fmt: skip
        penalty = torch.tensor(values, dtype=torch.float32, device=logits.device).unsqueeze(1)
        sub = logits.index_select(0, index).float()
        penalised = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
        logits[index] = penalised.clamp_max(torch.finfo(logits.dtype).max).to(logits.dtype)
        return logits


class _GeneratedCountPenalty(_Penalty):
    """Subtracts ``penalty × amount(counts)`` where counts are each token's uses among the generated ones."""

    def amount(self, counts: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        index = row_index(selected, logits)
        counts = _token_counts([rows.output_token_ids[i] for i in selected], logits.shape[-1], logits)
        penalty = _column([getattr(rows.params[i], self.field_name) for i in selected], logits)
        logits[index] = logits.index_select(0, index) - penalty * self.amount(counts).to(logits.dtype)
        return logits


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


def _check_ids(ids: Any, vocab: int, param: str) -> None:
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab:
            raise RequestError(f"token id {token_id!r} in {param} is outside the vocabulary [0, {vocab})", param)


class LogitBiasProcessor(LogitsProcessor):
    """Adds each row's ``logit_bias[token_id]`` (clamped to [-100, 100]) to that token's logit."""

    name = "logit_bias"
    fields = frozenset({"logit_bias"})
    order = 30

    def validate(self, params: SamplingParams, extensions: dict[str, Any], info: EngineInfo) -> None:
        _check_ids(params.logit_bias, info.vocab_size, "logit_bias")
        if any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in params.logit_bias.values()):
            raise RequestError("logit_bias values must be finite numbers", "logit_bias")

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return bool(params.logit_bias)

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        import torch

        rows_hit, token_index, values = [], [], []
        for i in selected:
            for token_id, bias in rows.params[i].logit_bias.items():
                rows_hit.append(i)
                token_index.append(int(token_id))
                values.append(max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(bias))))
        device = logits.device
        logits.index_put_(
            (torch.tensor(rows_hit, device=device), torch.tensor(token_index, device=device)),
            torch.tensor(values, dtype=logits.dtype, device=device),
            accumulate=True,
        )
        return logits


class AllowedTokenIdsProcessor(LogitsProcessor):
    """Masks every token not listed in the row's ``allowed_token_ids``."""

    name = "allowed_token_ids"
    fields = frozenset({"allowed_token_ids"})
    order = 10

    def validate(self, params: SamplingParams, extensions: dict[str, Any], info: EngineInfo) -> None:
        if params.allowed_token_ids is None:
            return
        if not params.allowed_token_ids:
            raise RequestError("allowed_token_ids must not be an empty list", "allowed_token_ids")
        _check_ids(params.allowed_token_ids, info.vocab_size, "allowed_token_ids")
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

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        import torch

        keep = torch.zeros((len(selected), logits.shape[-1]), dtype=torch.bool, device=logits.device)
        for row, i in enumerate(selected):
            keep[row, rows.params[i].allowed_token_ids] = True
        index = row_index(selected, logits)
        logits[index] = logits.index_select(0, index).masked_fill(~keep, -math.inf)
        return logits


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
        for i, word in enumerate(params.bad_words):
            if not isinstance(word, str) or not word:
                raise RequestError("bad_words must be non-empty strings", f"bad_words.{i}")
        self.token_sequences(tuple(params.bad_words))

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return bool(params.bad_words)

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        import torch

        rows_hit, token_index = [], []
        for i in selected:
            generated = rows.output_token_ids[i]
            for sequence in self.token_sequences(tuple(rows.params[i].bad_words)):
                prefix = sequence[:-1]
                if not prefix or (len(generated) >= len(prefix) and tuple(generated[-len(prefix) :]) == prefix):
                    rows_hit.append(i)
                    token_index.append(sequence[-1])
        if rows_hit:
            device = logits.device
            logits[torch.tensor(rows_hit, device=device), torch.tensor(token_index, device=device)] = -math.inf
        return logits


@hookimpl
def gyrfalcon_logits_processors(info: EngineInfo) -> list[LogitsProcessor]:
    """The built-in penalty, bias, allow-list and bad-words processors."""
    return [
        AllowedTokenIdsProcessor(),
        BadWordsProcessor(info.model_path),
        LogitBiasProcessor(),
        RepetitionPenaltyProcessor(),
        FrequencyPenaltyProcessor(),
        PresencePenaltyProcessor(),
    ]
