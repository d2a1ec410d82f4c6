"""What a serving process sets before its first BLAS call so that a sequence's results do not
depend on the sequences beside it (torch-free: the transformers engine's factory,
:func:`gyrfalcon.plugins.engines.create_transformers_engine`, calls it before it imports torch, so
the server, the benchmarks and the tests build the same engine; the test suite's conftest calls it
before anything else).

Why: torch's CPU attention (SDPA's fused kernel) computes each head with MKL's ``sgemm``, and MKL
may take a different code path by the alignment of the buffers it is handed — the kernel's
scratch buffer is per thread, and which thread computes a sequence's heads depends on how many
sequences share the call. A decode row's attention then moved in its last bits with the batch
(3.8e-6 in a logit, measured on the default model: a row at a 215-token context decoded alone and
beside seven others), and the bf16-rounded matmul inputs carried that on: 2 to 3 of 24 seeded
requests drew a different token alone than in a batch. MKL's conditional numerical
reproducibility (``MKL_CBWR=AUTO,STRICT``) makes its results independent of alignment; with it the
same runs gave 0 of 24, at no cost measured (a batch-1 decode attention call 34 µs without and 29
with, batch 16 293 and 312). MKL reads the variable at its first call: setting it later does nothing.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: the environment that makes MKL's results independent of data alignment
REPRODUCIBLE_BLAS = {"MKL_CBWR": "AUTO,STRICT"}


def ask_for_reproducible_blas(env: MutableMapping[str, str] = os.environ) -> None:
    """Set :data:`REPRODUCIBLE_BLAS` in ``env`` where the user has not chosen otherwise."""
    for name, value in REPRODUCIBLE_BLAS.items():
        env.setdefault(name, value)
