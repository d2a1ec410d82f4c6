"""Built-in sampling policies: temperature, top-k, top-p and min-p as batch-shaped processors.

Each processor touches only the rows that ask for it (``selected``), with per-row parameters
gathered into one tensor, so a batch costs one vectorised pass per policy whatever its company.
Order follows vLLM: temperature, then min-p, then top-k and top-p (top-p over the top-k survivors).
The module imports torch only when a processor runs, so a torch-free frontend process can load it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from gyrfalcon.engine_api.types import EngineInfo, SamplingParams
from gyrfalcon.errors import RequestError
from gyrfalcon.hookspecs import hookimpl
from gyrfalcon.policies import BatchRows, LogitsProcessor, row_index

if TYPE_CHECKING:  # pragma: no cover
    import torch


def _row_values(rows: BatchRows, selected: list[int], name: str, logits: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.tensor([getattr(rows.params[i], name) for i in selected], dtype=logits.dtype, device=logits.device)


class TemperatureProcessor(LogitsProcessor):
    """Divides each asking row's logits by its temperature (greedy rows are left to argmax)."""

    name = "temperature"
    fields = frozenset({"temperature"})
    order = 100

    def validate(self, params: SamplingParams, extensions: dict[str, Any], info: EngineInfo) -> None:
        if not (math.isfinite(params.temperature) and params.temperature >= 0):
            raise RequestError("temperature must be a finite number >= 0", "temperature")

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return not params.greedy and params.temperature != 1.0

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        index = row_index(selected, logits)
        temperature = _row_values(rows, selected, "temperature", logits).unsqueeze(1)
        logits[index] = logits[index] / temperature
        return logits


class MinPProcessor(LogitsProcessor):
    """Drops tokens whose probability is below ``min_p`` times the row's highest probability."""

    name = "min_p"
    fields = frozenset({"min_p"})
    order = 200

    def validate(self, params: SamplingParams, extensions: dict[str, Any], info: EngineInfo) -> None:
        if not 0.0 <= params.min_p <= 1.0:
            raise RequestError("min_p must be in [0, 1]", "min_p")

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return not params.greedy and params.min_p > 0.0

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        index = row_index(selected, logits)
        sub = logits[index]
        probs = sub.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * _row_values(rows, selected, "min_p", logits).unsqueeze(1)
        logits[index] = sub.masked_fill(probs < threshold, -math.inf)
        return logits


class TopKProcessor(LogitsProcessor):
    """Keeps each asking row's ``top_k`` highest logits (ties with the k-th are kept)."""

    name = "top_k"
    fields = frozenset({"top_k"})
    order = 210

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def validate(self, params: SamplingParams, extensions: dict[str, Any], info: EngineInfo) -> None:
        if params.top_k < -1:
            raise RequestError("top_k must be -1 (disabled) or at least 1", "top_k")

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return not params.greedy and 0 < params.top_k < self.vocab_size

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        import torch

        index = row_index(selected, logits)
        sub = logits[index]
        k = torch.tensor([rows.params[i].top_k for i in selected], dtype=torch.long, device=logits.device)
        top = sub.topk(int(k.max()), dim=-1).values
        kth = top.gather(1, (k - 1).unsqueeze(1))
        logits[index] = sub.masked_fill(sub < kth, -math.inf)
        return logits


class TopPProcessor(LogitsProcessor):
    """Nucleus sampling: keeps the smallest set of top tokens whose probability reaches ``top_p``."""

    name = "top_p"
    fields = frozenset({"top_p"})
    order = 220

    def validate(self, params: SamplingParams, extensions: dict[str, Any], info: EngineInfo) -> None:
        if not 0.0 < params.top_p <= 1.0:
            raise RequestError("top_p must be in (0, 1]", "top_p")

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return not params.greedy and params.top_p < 1.0

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        index = row_index(selected, logits)
        sorted_logits, order = logits[index].sort(dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        top_p = _row_values(rows, selected, "top_p", logits).unsqueeze(1)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
        logits[index] = sorted_logits.scatter(-1, order, sorted_logits)
        return logits


@hookimpl
def gyrfalcon_logits_processors(info: EngineInfo) -> list[LogitsProcessor]:
    """The built-in sampling processors."""
    return [TemperatureProcessor(), MinPProcessor(), TopKProcessor(info.vocab_size), TopPProcessor()]
