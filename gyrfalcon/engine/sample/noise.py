"""Sampling noise keyed by (a choice's seed, the position it draws), never by batch company.

Two views of the same key:

- :func:`draw_uniforms` — the number in [0, 1) each row's token is drawn with, computed on the
  device for the whole batch (a counter-based hash: splitmix64's finaliser in wrapping int64
  arithmetic), so a step draws no random numbers from a stateful generator and syncs nothing;
- :class:`DrawGenerators` — a ``torch.Generator`` per row, seeded from :func:`noise_seed`, made only
  for the processors that ask for one.

Either way a choice batched with anyone, or preempted and recomputed, draws the same noise.
"""

from __future__ import annotations

import collections.abc
import hashlib

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def as_int64(value: int) -> int:
    """``value`` modulo 2**64 as a signed 64-bit integer (what an int64 tensor holds)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shift_right(x, 30)) * as_int64(_MIX1)
    x = (x ^ _shift_right(x, 27)) * as_int64(_MIX2)
    return x ^ _shift_right(x, 31)


def draw_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64 numbers in [0, 1), one per (seed, position) pair of int64 tensors."""
    key = _mix(seeds + as_int64(_GOLDEN))
    bits = _mix(key + (positions + 1) * as_int64(_GOLDEN))
    return _shift_right(bits, 11).double() * 2.0**-53


def noise_seed(seed: int, position: int) -> int:
    """The 63-bit seed of the generator a processor gets for a sequence's draw at ``position``."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class DrawGenerators(collections.abc.Sequence):
    """Per row, a ``torch.Generator`` seeded for this draw (None for greedy rows), made only when a
    processor asks for it: most steps need none."""

    def __init__(self, keys: list[tuple[int, int] | None], device: torch.device) -> None:
        self._keys = keys
        self._device = device
        self._made: dict[int, torch.Generator] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        key = self._keys[i]
        if key is None:
            return None
        if i not in self._made:
            self._made[i] = torch.Generator(device=self._device).manual_seed(noise_seed(*key))
        return self._made[i]
