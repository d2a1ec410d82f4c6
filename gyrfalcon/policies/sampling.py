"""Built-in sampling policies: temperature, top-k, top-p and min-p as batch-shaped processors.

Each processor touches only the rows that ask for it (``selected``). Its per-row parameter is
written once per sequence, into a per-slot device tensor, when the sequence joins the persistent
batch (``add_row``); a step gathers it by slot, so a batch costs one vectorised pass per policy
whatever its company, with no tensor built from Python values.
Order follows vLLM: temperature, then min-p, then top-k and top-p (top-p over the top-k survivors).
The module imports torch only when a processor runs, so a torch-free frontend process can load it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from gyrfalcon.engine_api.types import EngineInfo, SamplingParams
from gyrfalcon.policies import BatchRows, LogitsProcessor, NewRow, SlotTensor, put_rows, row_index, take_rows

if TYPE_CHECKING:  # pragma: no cover
    import torch


class _PerSlotValue(LogitsProcessor):
    """A processor driven by one number per row, kept per slot on the device (``field_name``)."""

    field_name = ""

    def __init__(self) -> None:
        self.values = SlotTensor((), "float32")

    def add_row(self, slot: int, row: NewRow) -> None:
        self.values.put(slot, float(getattr(row.params, self.field_name)), row.device)

    def column(self, rows: BatchRows, selected: list[int], index: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
        """``[k, 1]``: the value of each selected row, in the logits' dtype."""
        return self.values.take(rows.slots_of(selected, index)).to(logits.dtype).unsqueeze(1)


#: the largest temperature applied: any larger one (the API has no upper bound, as vLLM) samples
#: as near uniformly as this one, and dividing by it keeps every logit finite in any float dtype
MAX_APPLIED_TEMPERATURE = 1e4


class TemperatureProcessor(_PerSlotValue):
    """Divides each asking row's logits by its temperature (greedy rows are left to argmax)."""

    name = "temperature"
    fields = frozenset({"temperature"})
    field_name = "temperature"
    order = 100

    def add_row(self, slot: int, row: NewRow) -> None:
        self.values.put(slot, min(float(row.params.temperature), MAX_APPLIED_TEMPERATURE), row.device)

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return not params.greedy and params.temperature != 1.0

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        index = row_index(selected, logits)
        return put_rows(logits, index, take_rows(logits, index) / self.column(rows, selected, index, logits))


class MinPProcessor(_PerSlotValue):
    """Drops tokens whose probability is below ``min_p`` times the row's highest probability."""

    name = "min_p"
    fields = frozenset({"min_p"})
    field_name = "min_p"
    order = 200

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return not params.greedy and params.min_p > 0.0

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        index = row_index(selected, logits)
        sub = take_rows(logits, index)
        probs = sub.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * self.column(rows, selected, index, logits)
        return put_rows(logits, index, sub.masked_fill(probs < threshold, -math.inf))


class TopKProcessor(_PerSlotValue):
    """Keeps each asking row's ``top_k`` highest logits (ties with the k-th are kept)."""

    name = "top_k"
    fields = frozenset({"top_k"})
    field_name = "top_k"
    order = 210

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.values = SlotTensor((), "long")
        self.host_k: dict[int, int] = {}  # the widest k of a step is known without a device sync

    def add_row(self, slot: int, row: NewRow) -> None:
        self.values.put(slot, int(row.params.top_k), row.device)
        self.host_k[slot] = int(row.params.top_k)

    def remove_row(self, slot: int) -> None:
        self.host_k.pop(slot, None)

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return not params.greedy and 0 < params.top_k < self.vocab_size

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        index = row_index(selected, logits)
        sub = take_rows(logits, index)
        k = self.values.take(rows.slots_of(selected, index))
        widest = max(self.host_k[rows.slot_list[i]] for i in selected)
        kth = sub.topk(widest, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        return put_rows(logits, index, sub.masked_fill(sub < kth, -math.inf))


class TopPProcessor(_PerSlotValue):
    """Nucleus sampling: keeps the smallest set of top tokens whose probability reaches ``top_p``."""

    name = "top_p"
    fields = frozenset({"top_p"})
    field_name = "top_p"
    order = 220

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return not params.greedy and params.top_p < 1.0

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        index = row_index(selected, logits)
        sorted_logits, order = take_rows(logits, index).sort(dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        top_p = self.column(rows, selected, index, logits)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
        return put_rows(logits, index, sorted_logits.scatter(-1, order, sorted_logits))


def processors(info: EngineInfo) -> list[LogitsProcessor]:
    """The built-in sampling processors."""
    return [TemperatureProcessor(), MinPProcessor(), TopKProcessor(info.vocab_size), TopPProcessor()]
