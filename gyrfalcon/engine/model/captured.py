"""Decode steps at static shapes: bucket padding, static buffers and (on CUDA) captured graphs.

A decode step of ``B`` sequences whose longest context is ``W`` tokens runs in the bucket
``(B', L)``: ``B'`` the smallest batch bucket ≥ ``B``, ``L`` the smallest context bucket ≥ ``W``
(powers of two from 64, up to the context length). Each bucket owns static input buffers — token
ids, positions, KV slots, the block table of every row's first ``L`` tokens — and its output logits.
Padding rows write their KV to the scratch block and read only it, so they touch no sequence's
blocks; their logits are dropped. On CUDA each bucket's forward is captured once as a CUDA graph
(the first time it is needed) and replayed; elsewhere the same buffers run eagerly, so the path is
tested on the CPU too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gyrfalcon.engine.model.attention import StepMetadata

if TYPE_CHECKING:  # pragma: no cover
    from gyrfalcon.engine.model.runner import ModelRunner, Work

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_CONTEXT_BUCKET = 64


def _buckets(limit: int, candidates) -> list[int]:
    chosen = [c for c in candidates if c < limit]
    return [*chosen, limit]


@dataclass
class _Bucket:
    batch: int
    width: int
    ids: torch.Tensor
    positions: torch.Tensor
    step: StepMetadata
    logits: torch.Tensor | None = None
    graph: Any = None
    runs: int = field(default=0)


class DecodeSteps:
    """The static-shape decode path of a :class:`ModelRunner` (see the module docstring)."""

    def __init__(self, runner: ModelRunner, max_batch: int, max_model_len: int, graphs: bool) -> None:
        self.runner = runner
        self.graphs = graphs and runner.device.type == "cuda"
        self.batch_buckets = _buckets(max(max_batch, 1), BATCH_BUCKETS)
        widths, width = [], MIN_CONTEXT_BUCKET
        while width < max_model_len:
            widths.append(width)
            width *= 2
        self.width_buckets = [*widths, max_model_len]
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = None
        #: seconds spent capturing graphs so far (start-up report, bench)
        self.capture_s = 0.0

    def bucket(self, batch: int, width: int) -> tuple[int, int] | None:
        """The ``(batch, width)`` bucket of a step, None when it is larger than every bucket."""
        b = next((x for x in self.batch_buckets if x >= batch), None)
        w = next((x for x in self.width_buckets if x >= width), None)
        return None if b is None or w is None else (b, w)

    def _new(self, batch: int, width: int) -> _Bucket:
        device = self.runner.device
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)  # noqa: E731
        blocks = -(-width // self.runner.cache.block_size)
        step = StepMetadata(self.runner.cache, zeros(batch), decode_blocks=zeros(batch, blocks),
                            decode_positions=zeros(batch), decode_only=True)  # fmt: skip
        return _Bucket(batch, width, zeros(1, batch), zeros(1, batch), step)

    def _eager(self, bucket: _Bucket) -> torch.Tensor:
        bucket.step._masks.clear()  # computed anew from this step's buffers
        return self.runner.run_model(bucket.ids, bucket.positions, bucket.step, 0)

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
        with torch.cuda.graph(graph, pool=self._pool):
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
            if self.graphs:
                try:
                    self._capture(bucket)
                except Exception:  # noqa: BLE001 - an uncapturable model still serves, eagerly
                    log.exception("CUDA graph capture failed; decode steps run eagerly")
                    self.graphs = False
                    bucket.graph = None
        return bucket

    def run(self, works: list[Work]) -> torch.Tensor | None:
        """The ``[len(works), V]`` fp32 next-token logits of a decode step (None: no bucket fits)."""
        from gyrfalcon.engine.model.runner import block_tables

        key = self.bucket(len(works), max(w.start + 1 for w in works))
        if key is None:
            return None
        bucket = self.get(*key)
        n, bs = len(works), self.runner.cache.block_size
        pad = [0] * (bucket.batch - n)  # padding rows: token 0 at position 0 in the scratch slot 0
        rows = torch.tensor([
            [w.tokens[0] for w in works] + pad,
            [w.start for w in works] + pad,
            [w.blocks[w.start // bs] * bs + w.start % bs for w in works] + pad,
        ], dtype=torch.long)  # fmt: skip
        tables = block_tables([w.blocks for w in works] + [[]] * len(pad), bucket.step.decode_blocks.shape[1])
        step = bucket.step
        bucket.ids.copy_(rows[0:1], non_blocking=True)
        bucket.positions.copy_(rows[1:2], non_blocking=True)
        step.slot_mapping.copy_(rows[2], non_blocking=True)
        step.decode_positions.copy_(rows[1], non_blocking=True)
        step.decode_blocks.copy_(tables, non_blocking=True)
        bucket.runs += 1
        if bucket.graph is not None:
            bucket.graph.replay()
            assert bucket.logits is not None
            # a copy: the next replay (of any bucket: they share one memory pool) overwrites the output
            return bucket.logits[:n].to(torch.float32, copy=True)
        return self._eager(bucket)[:n].float()
