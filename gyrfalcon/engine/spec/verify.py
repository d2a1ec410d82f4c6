"""A step's speculation, around the batcher's forward (:meth:`gyrfalcon.engine.batcher.Batcher.step`):
which sequences feed draft tokens (:func:`drafts_of`), the draft rows (:func:`draft_works`), and
the draws from them in turns (:func:`draw_in_turns`). Why this computes the model's own tokens:
:mod:`gyrfalcon.engine.spec.drafter`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gyrfalcon.engine.model.heads import StepHeads
from gyrfalcon.engine.model.work import Work
from gyrfalcon.engine.spec.drafter import MAX_SEQUENCES, Drafter
from gyrfalcon.policies import to_device


def drafts_of(plan: list[Any], draws: list[list[Any]], drafter: Drafter | None, scheduler: Any) -> list[list[int]]:
    """Per planned item (``Scheduled``), the draft tokens its sequence feeds beside its last one
    (none: it does not speculate; an empty list: no item does): only a decoding sequence drawing alone from its row, in a step of
    decode rows only, while the engine runs at most :data:`~gyrfalcon.engine.spec.drafter.MAX_SEQUENCES`
    sequences and none waits (a prefill or a newcomer is served first), with blocks free for the
    drafts' KV."""
    if (drafter is None or any(item.count != 1 for item in plan) or len(scheduler) > 0
            or scheduler.running_sequences() > MAX_SEQUENCES):  # fmt: skip
        return []  # no item drafts (the common step: nothing built per item)
    drafts: list[list[int]] = [[] for _ in plan]
    for i, (item, drawing) in enumerate(zip(plan, draws)):
        seq = item.seq
        if item.count != 1 or not item.state.forked or len(drawing) != 1 or drawing[0] is not seq:
            continue
        proposed = drafter.propose(seq)
        if proposed and scheduler.reserve(seq, 1 + len(proposed)):
            drafts[i] = proposed
    return drafts


def draft_works(plan: list[Any], drafts: list[list[int]]) -> list[Work]:
    """One single-token row per draft token, at the positions after its sequence's last token:
    decode rows of the same sequence (its block table's row), laid after every item's own work."""
    return [Work([token], item.seq.computed + 1 + i, item.seq.blocks, "last", owner=item.seq)
            for item, tokens in zip(plan, drafts) for i, token in enumerate(tokens)]  # fmt: skip


def draw_in_turns(plan: list[Any], drafts: list[list[int]], spans: list[tuple[int, int]],
                  logits: torch.Tensor, sample: Callable[[StepHeads, list[tuple[Any, Any]], None], None],
                  drafter: Drafter, scheduler: Any) -> None:  # fmt: skip
    """After the step's own draws: a sequence whose last drawn token equals its next draft keeps
    that draft's KV and draws from the draft's row (``sample``: the batcher's, appending the token
    and its logprobs) — what the step after it would have drawn —; the first that differs ends its
    speculation (the rows after it are never read; their KV is overwritten later). ``spans``: the
    draft works' rows of ``logits``."""
    rows_of: list[list[int]] = []
    for tokens in drafts:
        rows_of.append([first for first, _ in spans[: len(tokens)]])
        spans = spans[len(tokens) :]
    live = [i for i, tokens in enumerate(drafts) if tokens]
    accepted = dict.fromkeys(live, 0)
    turn = 0
    while live:
        drawing: list[tuple[Any, Any]] = []
        rows: list[int] = []
        for i in live:
            seq, state = plan[i].seq, plan[i].state
            # it drew at the last turn (its tokens one past its KV), and drew the draft
            if (seq.finished or state.closed or state.abort_requested or seq.num_tokens != seq.computed + 1
                    or seq.token_ids[-1] != drafts[i][turn]):  # fmt: skip
                continue
            seq.computed += 1  # the draft's KV is the sequence's own
            accepted[i] += 1
            drawing.append((seq, state))
            rows.append(rows_of[i][turn])
        if rows:
            sample(StepHeads(logits.index_select(0, to_device(rows, logits.device))), drawing, None)
        turn += 1
        live = [i for i in live if accepted[i] == turn and turn < len(drafts[i])]
    for i, count in accepted.items():
        drafter.verified(plan[i].seq, len(drafts[i]), count)
        if count:
            scheduler.register_full_blocks(plan[i].state, plan[i].seq)
