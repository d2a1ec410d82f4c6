"""Quantised weights in a neutral, device-independent layout (what a GGUF holds, or a quantiser makes).

- :class:`Int4Weights`: a ``[N, K]`` matrix in groups of 32 along ``K``, each weight
  ``w = scale * q + minimum`` with ``q`` in 0..15 — GGUF's ``Q4_1`` exactly (``Q4_0`` is the case
  ``minimum = -8 * scale``), and what an fp checkpoint is quantised to with ``--quantization int4``.
- :class:`Int8Weights`: ``w = scale * q`` with ``q`` in -127..127 and one scale per output row —
  the layout of torch's ``_weight_int8pack_mm``; a ``Q8_0`` tensor (one scale per 32 weights) is
  re-quantised into it, with the error reported.

Scales stay in the precision they came in (fp16 from a GGUF); the layers convert them to the
activation dtype when they pack for a device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: weights per scale group of the int4 layout (GGUF's block size; torch's kernel takes 32..256)
GROUP = 32


def relative_error(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """``‖W − Ŵ‖ / ‖W‖`` (Frobenius), the figure printed for a re-quantised tensor."""
    ref = reference.float()
    return float((ref - approximation.float()).norm() / ref.norm().clamp_min(1e-30))


class Int4Weights:
    """``q`` ``[N, K]`` uint8 (0..15), ``scale`` and ``minimum`` ``[N, K // GROUP]``; made from a
    file's ``nibbles`` (:meth:`from_nibbles`), ``q`` is unpacked only when asked for (the kernels
    pack from the nibbles themselves: a weight swap's work)."""

    def __init__(self, q: torch.Tensor | None, scale: torch.Tensor, minimum: torch.Tensor,
                 nibbles: torch.Tensor | None = None) -> None:  # fmt: skip
        if q is None and nibbles is None:
            raise ValueError("int4 weights need q or their nibbles")
        self._q, self.scale, self.minimum = q, scale, minimum
        #: ``[N, K // 2]`` uint8 as on disk (:meth:`packed_nibbles`), when made from them
        self.nibbles = nibbles

    @property
    def q(self) -> torch.Tensor:
        if self._q is None:
            nibbles = self.nibbles
            self._q = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(nibbles.shape[0], -1)
        return self._q

    @property
    def shape(self) -> tuple[int, int]:
        if self._q is None:
            return int(self.nibbles.shape[0]), 2 * int(self.nibbles.shape[1])
        return int(self._q.shape[0]), int(self._q.shape[1])

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weights:
        """Asymmetric min/max quantisation per group of 32, ``Q4_1``'s rule: ``scale = (max − min) / 15``,
        scale and minimum kept in fp16 as a GGUF keeps them (the kernels read fp16 scales), ``q``
        rounded against the fp16 values."""
        n, k = weight.shape
        groups = weight.detach().float().reshape(n, k // GROUP, GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        low = low.half()
        scale = ((high - low.float()) / 15).half()
        safe = torch.where(scale > 0, scale.float(), torch.ones_like(high))
        q = ((groups - low.float()[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.uint8)
        return cls(q.reshape(n, k), scale, low)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        q = self.q.reshape(n, k // GROUP, GROUP).float()
        w = self.scale.float()[..., None] * q + self.minimum.float()[..., None]
        return w.reshape(n, k).to(dtype)

    def packed_nibbles(self) -> torch.Tensor:
        """``[N, K // 2]`` uint8: column ``2j`` in the low nibble, ``2j + 1`` in the high one (on disk)."""
        if self.nibbles is not None:
            return self.nibbles
        return self.q[:, 0::2] | (self.q[:, 1::2] << 4)

    @classmethod
    def from_nibbles(cls, nibbles: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> Int4Weights:
        return cls(None, scale, minimum, nibbles)


@dataclass
class Int8Weights:
    """``q`` ``[N, K]`` int8, ``scale`` ``[N]``: ``w = scale[:, None] * q``."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weights:
        """Symmetric per-row quantisation: ``scale = max |w| / 127``."""
        w = weight.detach().float()
        scale = w.abs().amax(dim=1) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (w / safe[:, None]).round().clamp(-127, 127).to(torch.int8)
        return cls(q, scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.scale.float()[:, None] * self.q.float()).to(dtype)
