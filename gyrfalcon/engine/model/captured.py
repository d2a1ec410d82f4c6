"""Decode steps at static shapes: bucket padding, static buffers, and a fast path that proves itself.

A decode step of ``B`` sequences whose longest context is ``W`` tokens runs in the bucket
``(B', L)``: ``B'`` the smallest batch bucket ≥ ``B``, ``L`` the smallest context bucket ≥ ``W``
(powers of two from 64, up to the context length; one, the context length, where attention reads
the blocks in place: its shapes do not depend on the context). Each bucket owns static input buffers — token
ids, positions, KV slots, the block table of every row's first ``L`` tokens — and its output logits.
Padding rows write their KV to the scratch block and read only it, so they touch no sequence's
blocks; their logits are dropped. The fast path replays them:

- ``cuda-graphs``: each bucket's forward captured once as a CUDA graph (batch buckets of the
  shortest contexts at start-up, the others the first time they are needed);
- ``compiled``: ``torch.compile`` (inductor) of the step on the CPU, the context width its one
  dynamic size, for batches up to :data:`COMPILED_MAX_BATCH`, compiled on a thread of its own while
  steps run eagerly and adopted between two steps (:meth:`DecodeSteps.poll`) (measured on the default model, direct
  forward: at batch 1 the compiled step takes about 13 ms against 18 eager, after a 35–50 s
  compile; a dynamic batch size compiled slower than eager, 135 ms against 70 at batch 16, and a
  compile per batch bucket takes about 70 s); larger batches take the runner's unpadded eager step;
- ``static``: the same buffers run eagerly (what a fast step computes, on any device: tests).

Every fast step is checked against the eager step on the same synthetic inputs before it serves
(:func:`check_fast_step`): the same argmax in every row and logits within the model dtype's
tolerance (:data:`FAST_STEP_RTOL`) for a CUDA graph; for the CPU's compiled step, the same logits
to the last bit. Otherwise that bucket runs eagerly and :attr:`DecodeSteps.path` says why. The
compiled step must also be measurably faster, or it is dropped.

Why bit for bit on the CPU: a request's decode steps take the compiled path alone and the eager
one beside other requests (batches above :data:`COMPILED_MAX_BATCH`, steps that carry a prefill),
so the two must agree exactly for a seeded request to get the same tokens alone and in any batch.
They do on the direct forward (:mod:`~gyrfalcon.engine.model.decoder`): cos/sin are looked up,
not computed, RMSNorm runs as an opaque operator, attention takes the same shapes compiled and
eager; before that they rounded apart from position 1 on (up to 0.08 nats on the default model).
Transformers' forward computes all three inside the step, so it is not compiled.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gyrfalcon.engine.model import staging
from gyrfalcon.engine.model.attention import StepMetadata
from gyrfalcon.engine.model.work import Work, block_tables

if TYPE_CHECKING:  # pragma: no cover
    from gyrfalcon.engine.model.runner import ModelRunner

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_CONTEXT_BUCKET = 64
#: the fast paths a runner can ask for, and the eager static one
MODES = ("cuda-graphs", "compiled", "static")
#: the largest batch the compiled CPU step serves (see the module docstring)
COMPILED_MAX_BATCH = 1
#: the decode path's reason while a compile runs in the background (steps run eagerly meanwhile)
COMPILING = "compiling the decode step in the background"
#: the compiled step is kept only if its median time is at most this share of the eager step's
COMPILED_MUST_TAKE = 0.9
#: how far a fast step's logits may be from the eager step's, relative to the largest logit (at
#: least 1), by the model's dtype: fp32 reassociation moves the tiny model's by 6e-8
FAST_STEP_RTOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclass
class DecodePath:
    """Which path decode steps take — ``captured``, ``compiled`` or ``eager`` — and why."""

    name: str
    reason: str = ""

    def describe(self) -> str:
        return f"{self.name} ({self.reason})" if self.reason else self.name


def _one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, at most 300 characters (a reason in the decode path)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def check_fast_step(fast, eager, rtol: float = 0.0, names: tuple[str, str] = ("fast step", "eager one")) -> str | None:
    """Run ``fast()`` then ``eager()`` (each returns the step's logits from the same inputs); None
    when every row has the same argmax and ``max |Δ| <= rtol * max(1, max |logit|)``, else why not
    (the exception, or how far apart they are), the two named by ``names``."""
    name, other = names
    try:
        got = fast()
    except Exception as exc:  # noqa: BLE001 - any failure of the fast path means eager
        return f"the {name} failed: {_one_line(exc)}"
    want = eager()
    if got.shape != want.shape:
        return f"the {name}'s logits have shape {tuple(got.shape)}, the {other}'s {tuple(want.shape)}"
    got, want = got.float(), want.float()
    diff = float((got - want).abs().max())
    same = bool(torch.equal(got.argmax(-1), want.argmax(-1)))
    if not same or diff > rtol * max(1.0, float(want.abs().max())):
        return f"the {name} differs from the {other} (max |Δ logit| {diff:.3g}, argmax {'same' if same else 'different'})"
    return None


def _guards_on_the_inputs(entries) -> list[bool]:
    """The dynamo guards a compiled step keeps: those on its inputs (a bucket's tensors and step
    metadata) and on global state; not the ~3,400 on the model's modules and on module globals,
    which never change once the model is loaded (checking them took 1.2 ms a step on the default
    model)."""
    return [not entry.name.startswith(("self", "G[")) for entry in entries]


def _median_s(fn, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _buckets(limit: int, candidates) -> list[int]:
    chosen = [c for c in candidates if c < limit]
    return [*chosen, limit]


@dataclass
class _PendingCompile:
    """A compile running on its own thread, on a bucket of its own; ``result`` once it ends."""

    thread: threading.Thread
    bucket: _Bucket
    result: tuple[Any, float, str | None] = (None, 0.0, "the compile thread ended without a result")


@dataclass
class _Bucket:
    batch: int
    width: int
    ids: torch.Tensor
    positions: torch.Tensor
    step: StepMetadata
    #: the one buffer ``ids``, ``positions`` and the step's tensors are views of
    flat: torch.Tensor
    logits: torch.Tensor | None = None
    graph: Any = None
    #: why this bucket's captured graph was not kept (None: it was, or none was asked for)
    failure: str | None = None
    #: the compiled step serves this bucket (checked at start-up)
    compiled: bool = False
    runs: int = field(default=0)


class DecodeSteps:
    """The static-shape decode path of a :class:`ModelRunner` (see the module docstring)."""

    def __init__(self, runner: ModelRunner, max_batch: int, max_model_len: int, mode: str = "static") -> None:
        if mode not in MODES:
            raise ValueError(f"decode step mode must be one of {MODES}, got {mode!r}")
        self.runner = runner
        self.mode = "static" if mode == "cuda-graphs" and runner.device.type != "cuda" else mode
        self._compiled = None
        #: a compile running in the background (:meth:`prepare`), until :meth:`poll` adopts it
        self._pending: _PendingCompile | None = None
        #: a compiled CPU step must give the eager step's bits (see the module docstring)
        self.rtol = 0.0 if self.mode == "compiled" else FAST_STEP_RTOL.get(runner.cache.shape.dtype, 1e-4)
        #: the path decode steps take (set by :meth:`prepare`)
        self.path = DecodePath("eager", "static buffers, no fast path asked for" if self.mode == "static" else "not prepared")
        self.batch_buckets = _buckets(max(max_batch, 1), BATCH_BUCKETS)
        widths, width = [], MIN_CONTEXT_BUCKET
        while width < max_model_len:
            widths.append(width)
            width *= 2
        self._widths = [*widths, max_model_len]
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = None
        #: seconds spent capturing graphs so far (start-up report, bench)
        self.capture_s = 0.0

    @property
    def width_buckets(self) -> list[int]:
        """The context buckets: one, the longest, where attention reads the blocks in place (its
        step's shapes do not depend on the context)."""
        return self._widths[-1:] if self.runner.attention == "flex" else self._widths

    @property
    def graphs(self) -> bool:
        """Whether buckets are captured as CUDA graphs."""
        return self.mode == "cuda-graphs"

    def bucket(self, batch: int, width: int) -> tuple[int, int] | None:
        """The ``(batch, width)`` bucket of a step, None when it is larger than every bucket."""
        b = next((x for x in self.batch_buckets if x >= batch), None)
        w = next((x for x in self.width_buckets if x >= width), None)
        return None if b is None or w is None else (b, w)

    def _new(self, batch: int, width: int) -> _Bucket:
        """A bucket's inputs — ids, positions, KV slots, the rows' positions, the block table — as
        views of one device buffer, which each step fills with one copy."""
        blocks = -(-width // self.runner.cache.block_size)
        flat = torch.zeros(4 * batch + batch * blocks, dtype=torch.long, device=self.runner.device)
        ids, positions, slots, rows_at, table = staging.split(flat, [batch] * 4 + [batch * blocks])
        step = StepMetadata(self.runner.cache, slots, decode_blocks=table.view(batch, blocks),
                            decode_positions=rows_at, decode_only=True, attention=self.runner.attention)  # fmt: skip
        if self.mode == "compiled":  # one compiled graph for every width: the table's width is dynamic
            torch._dynamo.maybe_mark_dynamic(step.decode_blocks, 1)
        return _Bucket(batch, width, ids.view(1, batch), positions.view(1, batch), step, flat)

    def _eager(self, bucket: _Bucket) -> torch.Tensor:
        bucket.step._masks.clear()  # computed anew from this step's buffers
        return self.runner.run_model(bucket.ids, bucket.positions, bucket.step, 0)

    def _fill_synthetic(self, bucket: _Bucket) -> None:
        """A synthetic batch for the self-check: distinct tokens at distinct positions from the
        bucket's last one down (contexts of several blocks, and positions past 0, whose rotary
        angles are not trivial), every row in the scratch block (its KV is written there and read
        back, as padding rows' is)."""
        bs = self.runner.cache.block_size
        rows = torch.arange(bucket.batch)
        positions = (bucket.width - 1 - rows) % bucket.width
        bucket.ids.copy_((5 + rows).remainder(self.runner.logits_width).unsqueeze(0))
        bucket.positions.copy_(positions.unsqueeze(0))
        bucket.step.slot_mapping.copy_(positions % bs)
        bucket.step.decode_positions.copy_(positions)
        bucket.step.decode_blocks.zero_()

    def _run_compiled(self, bucket: _Bucket, compiled=None) -> torch.Tensor:
        bucket.step._masks.clear()
        return (compiled or self._compiled)(bucket.ids, bucket.positions, bucket.step, 0)

    @torch.inference_mode()
    def prepare(self, background: bool = False) -> DecodePath:
        """Build and check the fast path at start-up; returns (and keeps in :attr:`path`) what runs.

        ``cuda-graphs``: every batch bucket of the shortest contexts is captured, largest first, and
        checked; ``compiled``: the step is compiled on a batch-1 bucket of its own, checked, and
        timed against the eager step — with ``background``, the compile runs on a thread of its
        own while steps run eagerly, and :meth:`poll` checks and adopts it between two steps. A
        bucket that fails its check runs eagerly.
        """
        if self.mode == "compiled" and self.runner.direct is None:
            self.path = DecodePath("eager", "transformers' forward is not compiled (its compiled step rounds apart from "
                                            "the eager one)")  # fmt: skip
        elif self.mode == "compiled":
            bucket = self._new(1, self.width_buckets[0])  # never a serving bucket: the compile may run beside steps
            if background:
                self._pending = _PendingCompile(threading.Thread(target=self._compile_in_background, args=(bucket,),
                                                                 name="gyrfalcon-compile", daemon=True), bucket)  # fmt: skip
                self._pending.thread.start()
                self.path = DecodePath("eager", COMPILING)
            else:
                self.path = self._adopt(bucket, *self._compile(bucket))
        elif self.graphs:
            reserved = torch.cuda.memory_reserved(self.runner.device)
            for batch in reversed(self.batch_buckets):
                self.get(batch, self.width_buckets[0])
            grown = (torch.cuda.memory_reserved(self.runner.device) - reserved) / 2**20
            failed = [f"batch {b.batch}: {b.failure}" for b in self._buckets.values() if b.failure]
            if not failed:
                self.path = DecodePath("captured", f"{len(self._buckets)} buckets in {self.capture_s:.1f} s, {grown:.0f} MiB")
            elif len(failed) == len(self._buckets):
                self.path = DecodePath("eager", failed[0])
            else:
                self.path = DecodePath("captured", f"eager for {'; '.join(failed)}")
        return self.path

    def _compile(self, bucket: _Bucket) -> tuple[Any, float, str | None]:
        """``torch.compile`` of the model's forward, compiled by one run on ``bucket``'s synthetic
        inputs: (the compiled step or None, seconds, why it failed)."""
        import torch._dynamo

        self._fill_synthetic(bucket)
        start = time.perf_counter()
        try:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
            # the model's forward (direct where it has one) with one dynamic size, the context width
            # (each bucket's table is marked): dynamic=True made every size symbolic, and dynamo's
            # symbolic reasoning took 219 s tracing the direct forward of the default model (4 s static)
            compiled = torch.compile(self.runner.run_model, options={"guard_filter_fn": _guards_on_the_inputs})
            self._run_compiled(bucket, compiled)  # compiles
        except Exception as exc:  # noqa: BLE001 - no compiler, an unsupported op: serve eagerly
            return None, time.perf_counter() - start, f"compiling the decode step failed: {_one_line(exc)}"
        return compiled, time.perf_counter() - start, None

    def _compile_in_background(self, bucket: _Bucket) -> None:
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
        return self.path

    def _adopt(self, bucket: _Bucket, compiled, compile_s: float, failure: str | None) -> DecodePath:
        """Serve ``compiled`` for batches up to :data:`COMPILED_MAX_BATCH` if it agrees with the
        eager step on ``bucket`` and is measurably faster; else the eager path and why."""
        if compiled is None:
            return DecodePath("eager", failure or "no compiled step")
        self.capture_s += compile_s
        self._fill_synthetic(bucket)
        problem = check_fast_step(lambda: self._run_compiled(bucket, compiled), lambda: self._eager(bucket), self.rtol)
        if problem is not None:
            return DecodePath("eager", problem)
        eager_s = _median_s(lambda: self._eager(bucket))
        compiled_s = _median_s(lambda: self._run_compiled(bucket, compiled))
        timing = f"{compiled_s * 1000:.1f} ms a step against {eager_s * 1000:.1f} eager at batch 1, compiled in {compile_s:.1f} s"
        if compiled_s > COMPILED_MUST_TAKE * eager_s:
            return DecodePath("eager", f"the compiled step is not faster: {timing}")
        self._compiled = compiled
        for b in self._buckets.values():
            b.compiled = b.batch <= COMPILED_MAX_BATCH
        return DecodePath("compiled", f"batch {COMPILED_MAX_BATCH}, {timing}")

    def _capture(self, bucket: _Bucket) -> None:
        start = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (lazy kernel initialisation)
            for _ in range(2):
                self._eager(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        bucket.step._masks.clear()
        # thread_local: another thread's CUDA call (the API's) during the capture does not break it
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            bucket.logits = self.runner.run_model(bucket.ids, bucket.positions, bucket.step, 0)
        self._pool = graph.pool()
        bucket.graph = graph
        self.capture_s += time.perf_counter() - start
        log.info("captured decode step batch %d, context %d in %.2f s", bucket.batch, bucket.width,
                 time.perf_counter() - start)  # fmt: skip

    def get(self, batch: int, width: int) -> _Bucket:
        """The bucket's buffers (captured on first use on CUDA)."""
        key = (batch, width)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = self._new(batch, width)
            bucket.compiled = self._compiled is not None and batch <= COMPILED_MAX_BATCH
            if self.graphs:
                self._fill_synthetic(bucket)
                problem = check_fast_step(lambda: self._capture_and_replay(bucket), lambda: self._eager(bucket), self.rtol)
                if problem is not None:  # this bucket serves eagerly; the others keep their graphs
                    log.warning("decode bucket batch %d, context %d runs eagerly: %s", batch, width, problem)
                    bucket.graph, bucket.failure = None, problem
        return bucket

    def _capture_and_replay(self, bucket: _Bucket) -> torch.Tensor:
        self._capture(bucket)
        bucket.graph.replay()
        assert bucket.logits is not None
        return bucket.logits.to(torch.float32, copy=True)

    def run(self, works: list[Work]) -> torch.Tensor | None:
        """The ``[len(works), V]`` fp32 next-token logits of a decode step (None: no bucket fits,
        or the step is one the compiled mode does not compile — the runner's unpadded step is the
        faster eager one: a padded bucket computed up to 7 rows and 60 columns more; 0.82 of the
        eager ceiling at c=16 against 1.0 before)."""
        if self.mode == "compiled" and (self._compiled is None or len(works) > COMPILED_MAX_BATCH):
            return None
        key = self.bucket(len(works), max(w.start + 1 for w in works))
        if key is None:
            return None
        bucket = self.get(*key)
        n, bs = len(works), self.runner.cache.block_size
        pad = [0] * (bucket.batch - n)  # padding rows: token 0 at position 0 in the scratch slot 0
        positions = [w.start for w in works] + pad
        values = [w.tokens[0] for w in works] + pad
        values += positions
        values += [w.blocks[w.start // bs] * bs + w.start % bs for w in works] + pad
        values += positions
        values += block_tables([w.blocks for w in works] + [[]] * len(pad), bucket.step.decode_blocks.shape[1])
        staging.upload(values, self.runner.device, into=bucket.flat)  # the step's one host-to-device copy
        bucket.runs += 1
        if bucket.graph is not None:
            bucket.graph.replay()
            assert bucket.logits is not None
            # a copy: the next replay (of any bucket: they share one memory pool) overwrites the output
            return bucket.logits[:n].to(torch.float32, copy=True)
        if bucket.compiled:
            return self._run_compiled(bucket)[:n].float()
        return self._eager(bucket)[:n].float()
