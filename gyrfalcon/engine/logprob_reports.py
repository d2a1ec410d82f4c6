"""Turning what the logprob gatherers collected into :class:`TokenLogprobs` reports.

One function, :func:`merge_gathered`, serves both the decode step (one row per sequence of the
batch) and the prompt (one row per prompt position): it runs every gatherer once on the rows that
want it — each gatherer vectorises across its rows — then merges, per row, the token itself with
every gatherer's ``(ids, logprobs)`` pairs in gatherer order, without duplicate ids. Values are
clamped to :data:`LOGPROB_FLOOR` so that nothing non-finite reaches the wire.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gyrfalcon.engine_api.types import LOGPROB_FLOOR, TokenLogprobs
from gyrfalcon.policies import BatchRows, LogprobGatherer


def finite(value: float) -> float:
    """``value`` clamped to :data:`LOGPROB_FLOOR` (``-inf`` and NaN become the floor)."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def merge_gathered(
    gatherers: Sequence[LogprobGatherer],
    logprobs: torch.Tensor,
    tokens: torch.Tensor,
    rows: BatchRows,
    selected: Sequence[list[int]],
) -> list[TokenLogprobs | None]:
    """One single-position report per row (None where no gatherer returned anything).

    ``logprobs``: ``[B, V]`` raw log-softmax; ``tokens``: ``[B]`` the token at each row's position
    (sampled, or the actual prompt token); ``selected[g]``: the rows gatherer ``g`` wants. A row's
    report holds its token and that token's logprob, then the gathered ids that are not yet listed.
    """
    reports: list[TokenLogprobs | None] = [None] * len(rows)
    if not any(selected):
        return reports
    token_list = tokens.tolist()
    own = logprobs.gather(1, tokens.view(-1, 1).to(torch.long)).view(-1).tolist()
    for g, gatherer in enumerate(gatherers):
        if not selected[g]:
            continue
        pairs = gatherer.gather(logprobs, tokens, rows, selected[g])
        for i, pair in enumerate(pairs):
            if pair is None:
                continue
            report = reports[i]
            if report is None:
                report = reports[i] = TokenLogprobs([token_list[i]], [finite(own[i])], [[]], [[]])
            ids, values = report.top_token_ids[0], report.top_logprobs[0]
            seen = set(ids)
            for token_id, value in zip(*pair):
                token_id = int(token_id)
                if token_id not in seen:
                    seen.add(token_id)
                    ids.append(token_id)
                    values.append(finite(float(value)))
    return reports
