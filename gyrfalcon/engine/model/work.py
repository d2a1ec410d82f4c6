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


def kept_count(work: Work) -> int:
    """How many rows of logits the step keeps for ``work``: its last positions' (one for
    ``"last"``, every position for ``"all"``, none for ``"none"``)."""
    return 1 if work.logits == "last" else len(work.tokens) if work.logits == "all" else 0


def kept_rows(work: Work) -> range:
    """The offsets (into ``work.tokens``) of the positions whose logits the step keeps."""
    return range(len(work.tokens) - kept_count(work), len(work.tokens))


def draw_rows(works: list[Work], draws: list[list[Any]]) -> tuple[list[int], bool]:
    """The rows of a step's logits (as the runner returns them) that its draws read: each item's
    last kept row once per sequence drawing from it (``draws[i]``); and whether that is every row
    in order."""
    rows: list[int] = []
    kept = 0
    for work, drawing in zip(works, draws):
        kept += kept_count(work)
        rows += [kept - 1] * len(drawing)
    return rows, len(rows) == kept and rows == list(range(kept))


class StepWorks(list):
    """The work items of one step (a list of :class:`Work`), with its ``rider`` (the sampler's rows and
    the rows the step draws from): integers that go to the device in the same copy as the step's
    inputs (None: none). Whatever wraps the runner's ``step(works)`` passes the rider on with the list."""

    def __init__(self, works: list[Work], rider: Rider | None = None) -> None:
        super().__init__(works)
        self.rider = rider


def riding(works: list[Work]) -> Rider | None:
    """The rider of a step's works (None for a plain list)."""
    return getattr(works, "rider", None)


def slots_of(blocks: list[int], start: int, stop: int, block_size: int) -> list[int]:
    """The cache slots of positions ``start .. stop - 1`` of a sequence whose block table is ``blocks``."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, stop)]
