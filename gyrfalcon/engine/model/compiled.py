"""The compiled mode of :class:`~gyrfalcon.engine.model.captured.DecodeSteps` (the CPU's fast path
where the layer loop of :mod:`~gyrfalcon.engine.model.layer_loop` does not run the layers):
``torch.compile`` of the model's forward for the batch buckets of
:data:`~gyrfalcon.engine.model.captured.COMPILED_BATCHES`, one after another on a thread of its own
while steps run eagerly, each checked and timed against the eager step and adopted between two
steps (:meth:`CompiledMode.poll`)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from gyrfalcon.engine.model.buckets import Bucket
from gyrfalcon.engine.model.fast_check import DecodePath, guards_on_the_inputs, one_line
from gyrfalcon.kernels.native.cpu import cpu
from gyrfalcon.heap import release_freed_memory


log = logging.getLogger(__name__)

#: the decode path's reason while a compile runs in the background (steps run eagerly meanwhile)
COMPILING = "compiling the decode step in the background"


@dataclass
class _PendingCompile:
    """A compile running on its own thread, on a bucket of its own; ``result`` once it ends."""

    thread: threading.Thread
    bucket: Bucket
    #: the batch buckets to compile after this one
    rest: list[int] = field(default_factory=list)
    result: tuple[Any, float, str | None] = (None, 0.0, "the compile thread ended without a result")


class CompiledMode:
    """The compile's part of a ``DecodeSteps``: its background thread, the compile of one bucket,
    and the poll that adopts it (the check and timing: ``DecodeSteps._adopt``)."""

    _compiled: Any
    _pending: _PendingCompile | None
    #: when the first background compile started (the server is ready then)
    _started: float = 0.0

    def _run_compiled(self, bucket: Bucket, compiled=None) -> torch.Tensor:
        bucket.step._masks.clear()
        return (compiled or self._compiled)(bucket.ids, bucket.positions, bucket.step, 0)

    def _start_compile(self, batches: list[int]) -> None:
        """Compile the step for ``batches[0]`` on a thread of its own, then (through :meth:`poll`) the rest."""
        if self._pending is None and not self._compiled_batches:
            self._started = time.perf_counter()
        bucket = self._new(batches[0], self.width_buckets[0])  # never a serving bucket: the compile runs beside steps
        self._pending = _PendingCompile(threading.Thread(target=self._compile_in_background, args=(bucket,),
                                                         name="gyrfalcon-compile", daemon=True), bucket, batches[1:])  # fmt: skip
        self._pending.thread.start()

    def _compile(self, bucket: Bucket) -> tuple[Any, float, str | None]:
        """``torch.compile`` of the model's forward (the one already made, for a later bucket),
        compiled for ``bucket``'s shapes by one run on its synthetic inputs: (the compiled step or
        None, seconds, why it failed)."""
        import torch._dynamo

        self._fill_synthetic(bucket)
        start = time.perf_counter()
        try:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
            if cpu().avx2 and not cpu().avx512:
                # inductor's vectors at torch's instruction set: capped to AVX2 on an AVX-512 CPU
                # (ATEN_CPU_CAPABILITY=avx2), its own choice made steps of NaNs on the tiny model
                import torch._inductor.config

                torch._inductor.config.cpp.simdlen = 256
            # the model's forward (direct where it has one) with one dynamic size, the context width
            # (each bucket's table is marked): dynamic=True made every size symbolic, and dynamo's
            # symbolic reasoning took 219 s tracing the direct forward of the default model (4 s static)
            compiled = self._compiled or torch.compile(self.runner.run_model,
                                                       options={"guard_filter_fn": guards_on_the_inputs})
            self._run_compiled(bucket, compiled)  # compiles
        except Exception as exc:  # noqa: BLE001 - no compiler, an unsupported op: serve eagerly
            return None, time.perf_counter() - start, f"compiling the decode step failed: {one_line(exc)}"
        return compiled, time.perf_counter() - start, None

    def _compile_in_background(self, bucket: Bucket) -> None:
        with torch.inference_mode():  # a thread's own mode
            self._pending.result = self._compile(bucket)

    def poll(self) -> DecodePath | None:
        """Between two steps (the engine's thread): adopt a background compile that has finished —
        checked and timed against the eager step here, where no step runs beside it — and return
        the new path; None while there is nothing new."""
        pending = self._pending
        if pending is None or pending.thread.is_alive():
            return None
        self._pending = None
        with torch.inference_mode():
            self.path = self._adopt(pending.bucket, *pending.result)
        release_freed_memory()  # what compiling took and left (about 330 MiB on the default model's five buckets)
        if self._compiled_batches and pending.rest:  # the next batch bucket, while this one serves
            self._start_compile(pending.rest)
            self.path = DecodePath("compiled", f"{self.path.reason}; {COMPILING} for batch {pending.rest[0]}")
        else:  # the last one: from now on every step runs at full speed
            settled = time.perf_counter() - self._started
            log.warning("the decode path settled %.0f s after the server was ready: %s", settled, self.path.describe())
            self.path = DecodePath(self.path.name, f"{self.path.reason}; settled {settled:.0f} s after ready")
        return self.path

