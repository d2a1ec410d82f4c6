"""The persistent block table: every running sequence's blocks as a row of one device tensor.

A step's attention needs each sequence's block table on the device. Rebuilt and sent every step,
the tables cost the host ``batch × blocks`` integers a step (64 sequences of 4,096 tokens: 16,384
of them, about 1 ms of Python here), and with in-place attention, whose one context bucket is the
whole context, that much at any length. Here a sequence keeps its row between steps: a step sends
only the entries that changed — the blocks a sequence gained since its last step, a few per step —
with its other inputs, and attention reads rows of the tensor where they lie.

Row 0 is the scratch row: all zeros, the scratch block's, for a static bucket's padding rows. A
sequence gives its row back when its blocks are released (:meth:`BlockTable.release`, a listener of
the scheduler's releases). Blocks are only ever appended to a sequence's list while it holds a row;
a list replaced by another (a fork, a prefix-cache hit) is written anew.
"""

from __future__ import annotations

from typing import Any

import torch


class BlockTable:
    """``[rows, max_blocks]`` block ids on ``device``, one row per sequence (see the module docstring)."""

    def __init__(self, max_blocks: int, device: torch.device | str, rows: int = 16) -> None:
        self.max_blocks = max_blocks
        self.device = torch.device(device)
        self.tensor = torch.zeros(max(rows, 2), max_blocks, dtype=torch.long, device=self.device)
        self._row_of: dict[Any, int] = {}
        self._lists: dict[int, list[int]] = {}  # row -> the block list it mirrors (by identity)
        self._written: dict[int, int] = {}  # row -> how many of its blocks are in the tensor
        self._high: dict[int, int] = {}  # row -> columns that may hold an earlier owner's blocks
        self._free: list[int] = list(range(self.tensor.shape[0] - 1, 0, -1))
        self._temporary: list[Any] = []
        #: the entries not yet in the tensor: rows, columns, block ids
        self.pending: tuple[list[int], list[int], list[int]] = ([], [], [])

    def place(self, owner: Any, blocks: list[int]) -> int:
        """``owner``'s row (taken on its first step), its new blocks queued in :attr:`pending`.
        ``owner`` None: a row for this step only (work built by hand), given back by the next
        :meth:`settle`."""
        if len(blocks) > self.max_blocks:
            raise ValueError(f"a sequence holds {len(blocks)} blocks; the table has {self.max_blocks} columns")
        if owner is None:
            owner = object()
            self._temporary.append(owner)
        row = self._row_of.get(owner)
        if row is None:
            row = self._row_of[owner] = self._take_row()
            self._written[row] = 0
        if self._lists.get(row) is not blocks:
            self._lists[row], self._written[row] = blocks, 0
        written, count = self._written[row], len(blocks)
        rows, columns, ids = self.pending
        if count > written:
            rows.extend([row] * (count - written))
            columns.extend(range(written, count))
            ids.extend(blocks[written:])
            self._written[row] = count
        high = self._high.get(row, 0)
        if written == 0 and high > count:  # an earlier owner's blocks past this one's: the scratch block again
            rows.extend([row] * (high - count))
            columns.extend(range(count, high))
            ids.extend([0] * (high - count))
        self._high[row] = max(count, high) if written else count
        return row

    def take_pending(self) -> list[int]:
        """The queued entries, laid out to go to the device with a step's inputs (rows, then
        columns, then block ids; :meth:`apply` reads them back)."""
        rows, columns, ids = self.pending
        self.pending = ([], [], [])
        if len(rows) > 1 and len(set(zip(rows, columns))) < len(rows):
            # one entry written twice (a row reused before a failed step's entries went out): the
            # last wins, as the device would not promise for duplicates in one write
            latest = dict(zip(zip(rows, columns), ids))
            rows, columns, ids = [r for r, _ in latest], [c for _, c in latest], list(latest.values())
        return [*rows, *columns, *ids]

    def requeue(self, laid: list[int]) -> None:
        """Queue again entries :meth:`take_pending` laid out that never reached the device, before
        any queued since (a later entry for the same place wins)."""
        if laid:
            rows, columns, ids = (laid[i : i + len(laid) // 3] for i in range(0, len(laid), len(laid) // 3))
            self.pending = (rows + self.pending[0], columns + self.pending[1], ids + self.pending[2])

    def apply(self, sent: torch.Tensor) -> None:
        """Write the entries :meth:`take_pending` laid out, now on the device, into the table."""
        if sent.numel():
            rows, columns, ids = sent.view(3, -1)
            self.tensor.index_put_((rows, columns), ids)

    def rows(self, rows: torch.Tensor, blocks: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[len(rows), blocks]``: the first ``blocks`` columns of ``rows`` (a copy; into ``out``,
        whose width is then ``blocks``, when given)."""
        blocks = out.shape[1] if out is not None else blocks
        return torch.index_select(self.tensor[:, :blocks], 0, rows, out=out)

    def release(self, owner: Any) -> None:
        """``owner``'s blocks were released: its row is free (a no-op when it holds none)."""
        row = self._row_of.pop(owner, None)
        if row is None:
            return
        self._lists.pop(row, None)
        self._written.pop(row, None)
        self._free.append(row)  # its entries stay until the row's next owner overwrites or clears them

    def settle(self) -> None:
        """Before a step: give back the rows of the last step's work built by hand (they stay valid
        while that step runs)."""
        for owner in self._temporary:
            self.release(owner)
        self._temporary.clear()

    def _take_row(self) -> int:
        if not self._free:
            old = self.tensor
            self.tensor = torch.zeros(2 * old.shape[0], self.max_blocks, dtype=old.dtype, device=self.device)
            self.tensor[: old.shape[0]] = old
            self._free = list(range(self.tensor.shape[0] - 1, old.shape[0] - 1, -1))
        return self._free.pop()
