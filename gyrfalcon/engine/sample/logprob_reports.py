"""Turning what the logprob gatherers collected into :class:`TokenLogprobs` reports.

One path serves both the decode step (one row per sequence of the batch) and the prompt (one row
per prompt position): :func:`gather_pending` runs every gatherer once on the rows that want it —
each gatherer vectorises across its rows and leaves its result on the device
(:class:`gyrfalcon.policies.Gathered`) — and :meth:`PendingReports.finish` merges, per row, the
token itself with every gatherer's ids in gatherer order, without duplicates, once the values have
reached the host. The step copies them there together with its sampled ids in one transfer
(:func:`to_host`). Values are clamped to :data:`LOGPROB_FLOOR` so nothing non-finite reaches the wire.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gyrfalcon.engine_api.types import LOGPROB_FLOOR, TokenLogprobs
from gyrfalcon.policies import BatchRows, Gathered, LogprobGatherer

Pairs = list[tuple[list[int], list[float]] | None]


def finite(value: float) -> float:
    """``value`` clamped to :data:`LOGPROB_FLOOR` (``-inf`` and NaN become the floor)."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def to_host(tensors: Sequence[torch.Tensor]) -> list[list[float]]:
    """Each tensor's values as a flat host list, copied in one transfer (as float64, which holds
    token ids below 2**53 and float32 values exactly)."""
    if not tensors:
        return []
    device = tensors[0].device
    flat = torch.cat([t.reshape(-1).to(device=device, dtype=torch.float64) for t in tensors]).tolist()
    out, start = [], 0
    for tensor in tensors:
        out.append(flat[start : start + tensor.numel()])
        start += tensor.numel()
    return out


class PendingReports:
    """The gatherers' results of one batch, still on the device; :meth:`finish` builds the reports
    from the host copies of :attr:`tensors`."""

    def __init__(self, size: int, tokens: torch.Tensor, own: torch.Tensor, parts: list[Gathered | Pairs]) -> None:
        self.size = size
        self.parts = parts
        self.tensors: list[torch.Tensor] = [tokens, own]
        for part in parts:
            if isinstance(part, Gathered):
                self.tensors.extend((part.ids, part.values))

    def finish(self, host: list[list[float]]) -> list[TokenLogprobs | None]:
        """One single-position report per row (None where no gatherer reported), from ``host``:
        :func:`to_host` of :attr:`tensors`."""
        reports: list[TokenLogprobs | None] = [None] * self.size
        tokens, own = host[0], host[1]
        next_tensor = 2

        def add(row: int, ids, values) -> None:
            report = reports[row]
            if report is None:
                report = reports[row] = TokenLogprobs([int(tokens[row])], [finite(own[row])], [[]], [[]])
            listed, listed_values = report.top_token_ids[0], report.top_logprobs[0]
            seen = set(listed)
            for token_id, value in zip(ids, values):
                token_id = int(token_id)
                if token_id not in seen:
                    seen.add(token_id)
                    listed.append(token_id)
                    listed_values.append(finite(float(value)))

        for part in self.parts:
            if isinstance(part, Gathered):
                ids, values = host[next_tensor], host[next_tensor + 1]
                next_tensor += 2
                width = part.ids.shape[-1] if part.ids.dim() == 2 else 0  # [rows, width] by contract
                for j, (row, count) in enumerate(zip(part.rows, part.widths)):
                    start, count = j * width, min(count, width)
                    add(row, ids[start : start + count], values[start : start + count])
            else:
                for row, pair in enumerate(part):
                    if pair is not None:
                        add(row, *pair)
        return reports


def gather_pending(
    gatherers: Sequence[LogprobGatherer],
    logprobs: torch.Tensor,
    tokens: torch.Tensor,
    rows: BatchRows,
    selected: Sequence[list[int]],
    own: torch.Tensor | None = None,
) -> PendingReports | None:
    """Run every gatherer on its rows (``selected[g]``) of ``logprobs`` (``[B, V]`` raw
    log-softmax), whose positions hold ``tokens`` (``[B]``: sampled, or the actual prompt token);
    None when no gatherer wants any row. ``own``: the tokens' logprobs, where the caller has them.
    A gatherer that returns host pairs synchronises itself."""
    if not any(selected):
        return None
    if own is None:
        own = logprobs.gather(1, tokens.view(-1, 1).to(torch.long)).view(-1)
    parts = [gatherer.gather(logprobs, tokens, rows, selected[g]) for g, gatherer in enumerate(gatherers) if selected[g]]
    return PendingReports(len(rows), tokens, own, parts)


def merge_gathered(
    gatherers: Sequence[LogprobGatherer],
    logprobs: torch.Tensor,
    tokens: torch.Tensor,
    rows: BatchRows,
    selected: Sequence[list[int]],
) -> list[TokenLogprobs | None]:
    """:func:`gather_pending` and its reports at once: a row's report holds its token and that
    token's logprob, then the gathered ids not yet listed (None where no gatherer reported)."""
    pending = gather_pending(gatherers, logprobs, tokens, rows, selected)
    if pending is None:
        return [None] * len(rows)
    return pending.finish(to_host(pending.tensors))
