"""A step's integer inputs — token ids, positions, KV slots, block tables, kept rows, and what the
sampler needs of its rows and the rows it draws from (a :class:`Rider`) — sent to the device in one copy: laid side by side in
one host tensor (pinned on CUDA, from torch's caching host allocator, so the copy is queued without
waiting), then read through views of the one device tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from gyrfalcon.engine.kv.table import BlockTable


@dataclass
class Rider:
    """Integers that travel with a step's inputs in their one host-to-device copy: ``values`` on the
    host, and ``tensor``, their view on the device, once the step that carried them has run (None
    when it did not: the owner then sends them itself)."""

    values: list[int]
    tensor: torch.Tensor | None = None

    def carry(self, values: list[int]) -> int:
        """Take ``values`` along too (after the owner's); returns their offset, for :meth:`part`."""
        offset = len(self.values)
        self.values.extend(values)
        return offset

    def part(self, offset: int, count: int) -> torch.Tensor | None:
        """``count`` values from ``offset`` on the device, once the step carried them (else None)."""
        return None if self.tensor is None else self.tensor[offset : offset + count]


def upload(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as one long tensor on ``device``, in one host-to-device copy (a captured step then
    copies its part on the device into the buffers its graph reads)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def send(parts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """``parts`` laid side by side and sent in one :func:`upload`; returns each part's view."""
    return split(upload(list(chain.from_iterable(parts)), device), [len(part) for part in parts])


def send_step(parts: list[list[int]], table: BlockTable, rider: Rider | None, device: torch.device) -> list[torch.Tensor]:
    """A step's ``parts``, the block table's pending entries and ``rider``'s values in one
    :func:`send`; the entries applied to the table and the rider's view set; returns the views of
    ``parts``. Entries that did not go out (the copy raised) are queued again for the next step."""
    pending = table.take_pending()
    try:
        sent = send([*parts, pending, rider.values if rider is not None else []], device)
    except BaseException:
        table.requeue(pending)
        raise
    table.apply(sent[-2])
    if rider is not None:
        rider.tensor = sent[-1]
    return sent[:-2]


def split(flat: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """The views of ``flat`` that :func:`upload` laid side by side, ``lengths[i]`` values each."""
    return list(torch.split(flat, lengths))
