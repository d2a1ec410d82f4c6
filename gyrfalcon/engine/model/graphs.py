"""Capturing a decode bucket's step as a CUDA graph (CUDA only; what it computes is the static
path's, which the CPU tests run eagerly: :mod:`gyrfalcon.engine.model.captured`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gyrfalcon.engine.model.heads import StepHeads, heads_of


def capture(forward: Callable[[], torch.Tensor], into: StepHeads,
            pool: Any) -> tuple[torch.cuda.CUDAGraph, StepHeads, Any]:  # fmt: skip
    """Capture ``forward`` (a bucket's step over its static buffers) and the sampler's reductions
    of its logits (:func:`heads_of`, written to the buffers ``into``, which every bucket shares)
    as one graph in memory pool ``pool`` (None: a new one); returns the graph, the heads it writes
    at each replay, and the pool (for the next bucket: the largest bucket is captured first, and
    the others reuse its memory)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph (lazy kernel initialisation)
        for _ in range(2):
            heads_of(forward(), into)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA call (the API's) during the capture does not break it
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        heads = heads_of(forward(), into)
    return graph, heads, graph.pool()


def pool_bytes(pool: Any) -> int | None:
    """The device memory the graphs' private pool ``pool`` holds, from the allocator's snapshot
    (None where the snapshot does not say)."""
    try:
        segments = torch.cuda.memory_snapshot()
        return sum(s["total_size"] for s in segments if tuple(s["segment_pool_id"]) == tuple(pool))
    except (KeyError, TypeError, RuntimeError):
        return None
