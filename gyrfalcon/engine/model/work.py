"""What one step asks of the model runner: a :class:`Work` item per scheduled sequence, and the
layout of block tables and KV slots the runner and the static decode buckets share."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Work:
    """Feed ``tokens`` at positions ``start ..`` of a sequence whose block table is ``blocks``.

    ``logits``: ``"last"`` (the next-token logits after the last one), ``"all"`` (one row per fed
    token: prompt logprobs) or ``"none"`` (a prefill chunk that does not reach the end).
    """

    tokens: list[int]
    start: int
    blocks: list[int]
    logits: str = "last"


def slots_of(blocks: list[int], start: int, stop: int, block_size: int) -> list[int]:
    """The cache slots of positions ``start .. stop - 1`` of a sequence whose block table is ``blocks``."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def block_tables(tables: list[list[int]], blocks: int) -> list[int]:
    """Each table's first ``blocks`` blocks, padded with the scratch block (0), whose columns lie
    past every row's position and are masked: ``len(tables) * blocks`` ids, row after row."""
    flat: list[int] = []
    for table in tables:
        head = table[:blocks]
        flat.extend(head)
        flat.extend([0] * (blocks - len(head)))
    return flat
