"""What a runner needs on its device beside the weights and the KV cache, measured before the cache is sized.

On CUDA the KV cache gets what is left of ``--gpu-memory-utilization`` once the weights are
loaded and this is set aside (:class:`StepReserve`):

- **the largest step's workspace**: one eager forward of ``max_num_batched_tokens`` tokens in
  prefill chunks, the first asking for every position's logits (as prompt logprobs do): the
  activations the caching allocator keeps for later steps;
- **the captured decode graphs' pool**: the graphs are captured largest bucket first into one
  memory pool, so it holds about the largest bucket's own activations, measured as one eager
  run of that bucket's step (at the context bucket captured at start-up: with flex attention the
  only one; with gather, wider buckets are captured when first needed and grow the pool then);
- **flex attention's masks**, whose tensors span every block of the cache: counted per block.

The heads buffers the buckets share (:func:`~gyrfalcon.engine.model.heads.empty_heads`) are
allocated before measuring, so the cache's sizing counts them as memory in use. The steps run on
a provisional cache of one full-length sequence's blocks, writing and reading the scratch block
alone, before the real cache exists: :func:`measure_reserve`, then ``runner.use_cache``. The
decode path's reason then gives the graphs' pool beside the measured figure. Not measured: a
step where several requests ask for prompt logprobs keeps every position's logits of each of
their chunks (the measured step keeps one chunk's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gyrfalcon.engine.model import flex
from gyrfalcon.engine.model.work import Work

if TYPE_CHECKING:  # pragma: no cover
    from gyrfalcon.engine.model.runner import ModelRunner

#: ``peak(fn)``: run ``fn`` and return the most device memory it held at once beyond what was allocated before it
PeakProbe = Callable[[Callable[[], object]], int]


def cuda_peak(device: torch.device) -> PeakProbe:
    """The :data:`PeakProbe` of a CUDA device: the caching allocator's peak while ``fn`` runs, over its start."""

    def peak(fn: Callable[[], object]) -> int:
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            return max(torch.cuda.max_memory_allocated() - base, 0)

    return peak


@dataclass(frozen=True)
class StepReserve:
    """Bytes set aside beside the KV cache: the largest eager step's workspace and the captured
    graphs' pool, and ``per_block`` more per block of the cache (flex attention's masks span the
    whole cache); ``outputs``, the heads buffers, are allocated by then (counted as in use)."""

    workspace: int
    graphs: int
    per_block: int = 0
    outputs: int = 0

    @property
    def total(self) -> int:
        """What the KV cache's budget leaves out, beyond the memory in use and ``per_block``."""
        return self.workspace + self.graphs

    def describe(self) -> str:
        mib = [f"{value / 2**20:.0f}" for value in (self.total, self.workspace, self.graphs, self.outputs)]
        per_block = f", and {self.per_block} bytes a KV block for attention's masks" if self.per_block else ""
        return (f"{mib[0]} MiB set aside for steps (workspace {mib[1]}, decode graphs {mib[2]}; their outputs "
                f"{mib[3]}){per_block}")  # fmt: skip


def provisional_blocks(max_model_len: int, block_size: int) -> int:
    """The blocks of the provisional cache the steps are measured on: the scratch block and a
    full-length sequence's (a block table of the longest context indexes into it)."""
    return 1 + -(-max_model_len // block_size)


def prefill_works(max_tokens: int, chunk: int, max_model_len: int, block_size: int) -> list[Work]:
    """The largest step: ``max_tokens`` tokens in prompt chunks of ``chunk`` (at most the context),
    each the last chunk of a full-length prompt (the widest context to attend to), every one in the
    scratch block, the first keeping every position's logits."""
    chunk = max(min(chunk, max_model_len, max_tokens), 1)
    blocks = [0] * -(-max_model_len // block_size)
    works: list[Work] = []
    left = max_tokens
    while left > 0:
        size = min(chunk, left)
        works.append(Work([5] * size, max_model_len - size, blocks, "all" if not works else "last"))
        left -= size
    return works


@torch.inference_mode()
def measure_reserve(runner: ModelRunner, max_tokens: int, chunk: int, max_model_len: int,
                    peak: PeakProbe) -> StepReserve:  # fmt: skip
    """On the runner's provisional cache (:func:`provisional_blocks`; steps write and read its
    scratch block alone), measure with ``peak`` the largest eager step and, when the runner
    captures decode steps, the largest start-up bucket's step; flex attention's masks are counted
    per block of the cache (:func:`~gyrfalcon.engine.model.flex.mask_bytes_per_block`)."""
    works = prefill_works(max_tokens, chunk, max_model_len, runner.cache.block_size)
    with runner.eager():
        workspace = peak(lambda: runner.forward(works))
    steps = runner.decode_steps
    per_block = 0
    if runner.attention == "flex":
        per_block = flex.mask_bytes_per_block(len(works), min(chunk, max_tokens))
        if steps is not None:
            per_block += flex.mask_bytes_per_block(steps.batch_buckets[-1], 1)
    if steps is None or not steps.graphs:
        return StepReserve(workspace, 0, per_block)
    graphs = steps.pool_budget = steps.pool_peak(peak)
    return StepReserve(workspace, graphs, per_block, steps.outputs.nbytes)
