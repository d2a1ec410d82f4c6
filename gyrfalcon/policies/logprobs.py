"""Built-in logprob gatherers: natural top-k, explicit ``logprob_token_ids``, prompt top-k.

All three read the raw log-softmax of the very logits the step sampled from (before any
processor), and each vectorises across the rows that want it — one ``topk`` or one ``gather`` per
step for the whole batch — and leaves its result on the device (the step copies it to the host
with the sampled ids, in one transfer). The explicit ids are written per slot when a sequence
joins the persistent batch. The engine merges their pairs behind the sampled token
(:func:`gyrfalcon.engine.sample.logprob_reports.merge_gathered`), so a position's report is:

- ``logprobs: k`` alone: the sampled token, then the ``k`` most likely tokens;
- with ``logprob_token_ids``: the sampled token, then exactly the requested ids — the ids
  supersede the top-k count (no displacement, no duplicates);
- ``prompt_logprobs: k``: at every prompt position after the first, the prompt token, then the
  ``k`` most likely tokens.

The counts and ids were bounded before (the documents' sizes, the deployment's ``max_logprobs`` and
vocabulary: :mod:`gyrfalcon.engine_api.limits`), so the gatherers validate nothing of their own. The
module imports torch only inside ``gather``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gyrfalcon.engine_api.types import EngineInfo, SamplingParams
from gyrfalcon.policies import BatchRows, Gathered, LogprobGatherer, NewRow, SlotTensor, to_device, row_index, take_rows
from gyrfalcon.engine_api.limits import field_keywords

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: most explicit ids per request (DESIGN §3 rule 2), as the documents bound the field
MAX_LOGPROB_TOKEN_IDS: int = field_keywords("logprob_token_ids")["maxItems"]


def top_k_gathered(logprobs: torch.Tensor, rows: list[int], counts: list[int]) -> Gathered:
    """Row ``rows[j]`` gets its ``counts[j]`` most likely ids (``-1``: the whole vocabulary); one
    ``topk`` for all of them, left on the device."""
    vocab = logprobs.shape[-1]
    counts = [vocab if c < 0 else min(c, vocab) for c in counts]
    sub = take_rows(logprobs, row_index(rows, logprobs))
    top = sub.topk(max(counts, default=0), dim=-1)
    return Gathered(rows, top.indices, top.values, counts)


class TopLogprobsGatherer(LogprobGatherer):
    """The ``logprobs`` most likely tokens at each generated position (any count, even 0).

    Every row with ``logprobs`` set gets a report (the sampled token at least); rows that also
    name ``logprob_token_ids`` get no top-k: the explicit ids supersede the count.
    """

    name = "top_logprobs"
    fields = frozenset({"logprobs"})

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return params.logprobs is not None

    def gather(self, logprobs: torch.Tensor, sampled: torch.Tensor, rows: BatchRows, selected: list[int]) -> Gathered:
        counts = [0 if rows.params[i].logprob_token_ids else rows.params[i].logprobs or 0 for i in selected]
        return top_k_gathered(logprobs, selected, counts)


class TokenIdsLogprobGatherer(LogprobGatherer):
    """The sampled token plus exactly every id of ``logprob_token_ids``, at each generated position."""

    name = "logprob_token_ids"
    fields = frozenset({"logprob_token_ids"})

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return bool(params.logprob_token_ids)

    def __init__(self) -> None:
        self.ids = SlotTensor((MAX_LOGPROB_TOKEN_IDS,), "long")
        self.widths: dict[int, int] = {}

    def add_row(self, slot: int, row: NewRow) -> None:
        ids = row.params.logprob_token_ids
        self.ids.row(slot, row.device)[: len(ids)] = to_device(ids, row.device)
        self.widths[slot] = len(ids)

    def remove_row(self, slot: int) -> None:
        self.widths.pop(slot, None)

    def gather(self, logprobs: torch.Tensor, sampled: torch.Tensor, rows: BatchRows, selected: list[int]) -> Gathered:
        import torch

        index = row_index(selected, logprobs)
        widths = [self.widths[rows.slot_list[i]] for i in selected]
        requested = self.ids.take(rows.slots_of(selected, index))[:, : max(widths)]
        columns = torch.cat([take_rows(sampled, index).long().unsqueeze(1), requested], dim=1)
        values = take_rows(logprobs, index).gather(1, columns)
        return Gathered(selected, columns, values, [1 + w for w in widths])


class PromptLogprobsGatherer(LogprobGatherer):
    """The ``prompt_logprobs`` most likely tokens at every prompt position (after the first)."""

    name = "prompt_logprobs"
    fields = frozenset({"prompt_logprobs"})
    positions = "prompt"

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return params.prompt_logprobs is not None

    def gather(self, logprobs: torch.Tensor, sampled: torch.Tensor, rows: BatchRows, selected: list[int]) -> Gathered:
        return top_k_gathered(logprobs, selected, [rows.params[i].prompt_logprobs or 0 for i in selected])


def gatherers(info: EngineInfo) -> list[LogprobGatherer]:
    """The built-in gatherers, in merge order: top-k, explicit ids, prompt top-k."""
    return [TopLogprobsGatherer(), TokenIdsLogprobGatherer(), PromptLogprobsGatherer()]
