"""What one step asks of the model runner: a :class:`Work` item per scheduled sequence (with the
sampler's :class:`~gyrfalcon.engine.model.staging.Rider`, :class:`StepWorks`), and the KV slots of
a sequence's positions, which the runner and the static decode buckets share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from gyrfalcon.engine.model.staging import Rider


@dataclass
class Work:
    """Feed ``tokens`` at positions ``start ..`` of a sequence whose block table is ``blocks``.

    ``logits``: ``"last"`` (the next-token logits after the last one), ``"all"`` (one row per fed
    token: prompt logprobs) or ``"none"`` (a prefill chunk that does not reach the end). ``owner``:
    the sequence, which keeps its row of the runner's persistent block table from step to step
    (``blocks`` is then its own list, only ever appended to); None for work built by hand, whose
    row lasts one step.
    """

    tokens: list[int]
    start: int
    blocks: list[int]
    logits: str = "last"
    owner: Any = None


def kept_rows(work: Work) -> range:
    """The offsets (into ``work.tokens``) of the positions whose logits the step keeps."""
    count = len(work.tokens)
    return {"last": range(count - 1, count), "all": range(count)}.get(work.logits, range(0))


def kept_spans(works: list[Work]) -> list[tuple[int, int]]:
    """Per work item, its ``(first row, row count)`` in the step's logits (what the runner returns)."""
    spans, first = [], 0
    for work in works:
        count = len(kept_rows(work))
        spans.append((first, count))
        first += count
    return spans


class StepWorks(list):
    """The work items of one step (a list of :class:`Work`), with the sampler's ``rider``: integers
    that go to the device in the same copy as the step's inputs (None: none). Whatever wraps the
    runner's ``forward(works)`` passes the rider on with the list."""

    def __init__(self, works: list[Work], rider: Rider | None = None) -> None:
        super().__init__(works)
        self.rider = rider


def riding(works: list[Work]) -> Rider | None:
    """The rider of a step's works (None for a plain list)."""
    return getattr(works, "rider", None)


def slots_of(blocks: list[int], start: int, stop: int, block_size: int) -> list[int]:
    """The cache slots of positions ``start .. stop - 1`` of a sequence whose block table is ``blocks``."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, stop)]
