"""What this CPU is, as the kernels see it: its model name, the instruction set torch dispatches to,
and the extensions past it that a kernel may use (native bf16, VNNI).

One home for the question, asked by the weight kernels' choice
(:func:`gyrfalcon.models.loading.kernel_dtype`), the C kernels' compiler flags
(:mod:`gyrfalcon.kernels.native`), the start-up line and the bench's header.

The instruction set is torch's own choice (``torch.backends.cpu.get_cpu_capability()``), not the
flags alone: ``ATEN_CPU_CAPABILITY=avx2`` caps it, and every extension beyond that set is then
taken as absent, so the AVX2 paths run, and are measured, on an AVX-512 machine too.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

#: ``/proc/cpuinfo`` flags of native bf16 arithmetic (AVX-512 BF16, AMX)
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@dataclass(frozen=True)
class CpuInfo:
    """A CPU as the kernels use it: ``isa`` is torch's capability (``AVX512``, ``AVX2``,
    ``DEFAULT``, or another architecture's name), ``flags`` those of ``/proc/cpuinfo``."""

    model: str
    isa: str
    flags: frozenset[str]
    cores: int

    @property
    def avx512(self) -> bool:
        return self.isa.startswith("AVX512")

    @property
    def avx2(self) -> bool:
        """At least AVX2 and FMA (AVX-512 included)."""
        return self.isa in ("AVX2",) or self.avx512

    @property
    def bf16(self) -> bool:
        """Native bf16 arithmetic inside the instruction set in use (AVX-512 BF16 or AMX)."""
        return self.avx512 and bool(self.flags & BF16_FLAGS)

    @property
    def vnni(self) -> bool:
        """AVX-512's int8 dot products (VNNI) inside the instruction set in use (AVX-VNNI, its 256-bit
        form on some AVX2-only CPUs, is not used: the AVX2 kernels are those of CPUs without it)."""
        return "avx512_vnni" in self.flags and self.avx512

    def describe(self) -> str:
        """``AMD EPYC 7B13 (AVX2; 2 cores)``: the model, the instruction set and what beyond it is used."""
        extras = [name for name, present in (("bf16", self.bf16), ("VNNI", self.vnni)) if present]
        return f"{self.model} ({', '.join([self.isa, *extras])}; {self.cores} cores)"


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return model or os.uname().machine, flags


@functools.cache
def cpu() -> CpuInfo:
    """This process's CPU (read once)."""
    import torch

    model, flags = _read_cpuinfo()
    return CpuInfo(model, torch.backends.cpu.get_cpu_capability(), flags, len(os.sched_getaffinity(0)))
