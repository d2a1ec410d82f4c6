"""What a runner needs on its device beside the weights and the KV cache, measured before the cache is sized.

On CUDA the KV cache gets what is left of ``--gpu-memory-utilization`` once the weights are
loaded and this is set aside (:class:`StepReserve`):

- **the largest step's workspace**: one eager forward of ``max_num_batched_tokens`` tokens in
  prefill chunks, the first asking for every position's logits (as prompt logprobs do): the
  activations the caching allocator keeps for later steps;
- **the captured decode graphs' pool**: the graphs are captured largest bucket first into one
  memory pool, so it holds about the largest bucket's own activations, measured as one eager
  run of that bucket's step (the widest context bucket: with gather attention its dense copy of
  the context is the largest).

The heads buffers the buckets share (:func:`~gyrfalcon.engine.model.heads.empty_heads`) are
allocated while measuring, so the cache's sizing counts them as memory in use. The steps run on
a provisional cache of the scratch block alone (every position writes and reads there), before
the real cache exists: :func:`measure_reserve`, then ``runner.use_cache``. The decode path's
start-up line then says how much the captured graphs took (``gpu_check`` compares the two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gyrfalcon.engine.model.work import Work

if TYPE_CHECKING:  # pragma: no cover
    from gyrfalcon.engine.model.runner import ModelRunner

#: ``peak(fn)``: run ``fn`` and return the most device memory it held at once beyond what was allocated before it
PeakProbe = Callable[[Callable[[], object]], int]


def cuda_peak(fn: Callable[[], object]) -> int:
    """:data:`PeakProbe` on CUDA: the caching allocator's peak while ``fn`` runs, over its start."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return max(torch.cuda.max_memory_allocated() - base, 0)


@dataclass(frozen=True)
class StepReserve:
    """Bytes set aside beside the KV cache: the largest eager step's workspace and the captured
    graphs' pool; ``outputs``, the heads buffers, are allocated by then (counted as in use)."""

    workspace: int
    graphs: int
    outputs: int = 0

    @property
    def total(self) -> int:
        """What the KV cache's budget leaves out, beyond the memory in use when it is sized."""
        return self.workspace + self.graphs

    def describe(self) -> str:
        mib = [f"{value / 2**20:.0f}" for value in (self.total, self.workspace, self.graphs, self.outputs)]
        return f"{mib[0]} MiB set aside for steps (workspace {mib[1]}, decode graphs {mib[2]}; their outputs {mib[3]})"


def prefill_works(max_tokens: int, chunk: int, max_model_len: int, block_size: int) -> list[Work]:
    """The largest step: ``max_tokens`` tokens in prompt chunks of ``chunk`` (at most the context),
    every one in the scratch block, the first keeping every position's logits."""
    chunk = max(min(chunk, max_model_len, max_tokens), 1)
    works: list[Work] = []
    left = max_tokens
    while left > 0:
        size = min(chunk, left)
        works.append(Work([5] * size, 0, [0] * -(-size // block_size), "all" if not works else "last"))
        left -= size
    return works


@torch.inference_mode()
def measure_reserve(runner: ModelRunner, max_tokens: int, chunk: int, max_model_len: int,
                    peak: PeakProbe = cuda_peak) -> StepReserve:  # fmt: skip
    """On the runner's provisional cache (the scratch block alone), measure with ``peak`` the
    largest eager step and, when the runner captures decode steps, its largest decode bucket."""
    works = prefill_works(max_tokens, chunk, max_model_len, runner.cache.block_size)
    with runner.eager():
        workspace = peak(lambda: runner.forward(works))
    steps = runner.decode_steps
    if steps is None or steps.mode == "compiled":
        return StepReserve(workspace, 0)
    graphs = steps.pool_budget = steps.pool_peak(peak)
    outputs = steps.outputs
    size = sum(t.numel() * t.element_size() for t in (outputs.logits, outputs.argmax, outputs.amax, outputs.logprobs,
                                                       outputs.own))  # fmt: skip
    return StepReserve(workspace, graphs, size)
