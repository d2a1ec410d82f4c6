"""The preallocated KV tensors and how many blocks fit the memory budget.

Per layer, keys and values are ``[num_blocks * block_size, kv_heads, head_dim]`` tensors allocated
once at start-up (zeroed, so resident memory is taken up front and stays flat): slot
``block * block_size + offset`` holds one token's KV. Nothing here knows requests; the runner
writes slots and reads them through block tables.
"""

from __future__ import annotations

import logging
import math

from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

#: the budget on CPU when ``--kv-cache-memory`` is not given: ``--max-num-seqs`` full-length
#: sequences, but at most one context of the model's length shared between them, or this many
#: tokens where that is more (llama-server's ``-c`` is one such context for all its slots) …
CPU_DEFAULT_TOKENS = 8192
#: … at most this many bytes …
CPU_DEFAULT_BYTES = 2 << 30
#: … and at most this share of the memory available at start-up
CPU_AVAILABLE_SHARE = 0.25


def cache_dtype(model_dtype: torch.dtype, quantized: bool) -> torch.dtype:
    """``--kv-cache-dtype auto``: the model's dtype (vLLM's ``auto``), except an fp32 model whose
    linear layers run quantised weights (a GGUF's bits, the CPU's default), whose cache is fp16 —
    what llama.cpp keeps for the same file. Its keys and values are rounded to 11 bits where the
    weights they came from hold 4 or 8: half the bytes (180 MiB of the default model's 8,192
    tokens) for a measured drift far inside the quality bar (docs/kernels.md, "KV cache"); an fp32
    model served unquantised keeps an fp32 cache, so its answers stay the model's own."""
    return torch.float16 if model_dtype == torch.float32 and quantized else model_dtype


@dataclass(frozen=True)
class KVShape:
    """What one token's KV takes: layers × (key + value) × kv heads × head dim, in ``dtype``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> KVShape:
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(int(config.num_hidden_layers), int(kv_heads), int(head_dim), dtype)

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class CachePlan:
    """How many blocks to allocate, and why (printed at start-up)."""

    num_blocks: int
    block_size: int
    bytes_per_token: int
    reason: str

    @property
    def tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    def describe(self, max_model_len: int) -> str:
        full = self.tokens // max(max_model_len, 1)
        return (f"KV cache: {self.num_blocks - 1} blocks of {self.block_size} tokens = {self.tokens} tokens, "
                f"{self.bytes / 2**20:.0f} MiB ({self.reason}); holds {full} full-length sequence(s) of "
                f"{max_model_len} tokens")  # fmt: skip


def _available_cpu_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def plan_cache(
    shape: KVShape,
    device: str,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    kv_cache_memory: int | None = None,
    gpu_memory_utilization: float = 0.9,
    reserve_bytes: int = 0,
    reserve_per_block: int = 0,
) -> CachePlan:
    """The block count: ``kv_cache_memory`` bytes when given; otherwise enough for ``max_num_seqs``
    full-length sequences, capped by what the device allows (CUDA: ``gpu_memory_utilization`` of
    the device minus what is allocated now and what the steps will take beside the cache,
    ``reserve_bytes`` and ``reserve_per_block`` for each block (:mod:`gyrfalcon.engine.model.budget`);
    CPU: one context of the model's length or :data:`CPU_DEFAULT_TOKENS` tokens, whichever is more,
    2 GiB and a quarter of the available memory)."""
    per_block = shape.bytes_per_token * block_size
    wanted = max_num_seqs * math.ceil(max_model_len / block_size) + 1
    if kv_cache_memory is not None:
        blocks, reason = kv_cache_memory // per_block, "--kv-cache-memory"
    else:
        blocks, reason = wanted, f"--max-num-seqs {max_num_seqs} full-length sequences"
        shared = math.ceil(max(max_model_len, CPU_DEFAULT_TOKENS) / block_size) + 1
        if not device.startswith("cuda") and shared < blocks:
            blocks, reason = shared, (f"one context of {max(max_model_len, CPU_DEFAULT_TOKENS)} tokens shared by "
                                      f"--max-num-seqs {max_num_seqs} sequences")  # fmt: skip
        if device.startswith("cuda"):
            free, total = torch.cuda.mem_get_info(torch.device(device))
            used_by_others = total - free - torch.cuda.memory_reserved(torch.device(device))
            allowed = (int(total * gpu_memory_utilization) - torch.cuda.memory_reserved(torch.device(device))
                       - max(used_by_others, 0) - reserve_bytes)  # fmt: skip
            cap = max(allowed, 0) // (per_block + reserve_per_block)
            why = f"--gpu-memory-utilization {gpu_memory_utilization}"
            if reserve_bytes:
                why += f", {reserve_bytes / 2**20:.0f} MiB set aside for steps"
        else:
            available = _available_cpu_bytes()
            limit = CPU_DEFAULT_BYTES if available is None else min(CPU_DEFAULT_BYTES, int(available * CPU_AVAILABLE_SHARE))
            cap, why = limit // per_block, f"capped at {limit / 2**30:.1f} GiB of host memory"
        if cap < blocks:
            blocks, reason = cap, why
    blocks = int(blocks)
    if blocks < 2:
        raise ValueError(f"the KV cache budget holds {max(blocks - 1, 0)} block(s) of {block_size} tokens: "
                         f"give more memory (--kv-cache-memory, --gpu-memory-utilization)")  # fmt: skip
    return CachePlan(blocks, block_size, shape.bytes_per_token, reason)


class PagedKVCache:
    """Per layer, the key and value slots of every block (see the module docstring)."""

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, device: str | torch.device) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        slots = num_blocks * block_size
        size = (slots, shape.num_kv_heads, shape.head_dim)
        self.keys = [torch.zeros(size, dtype=shape.dtype, device=self.device) for _ in range(shape.num_layers)]
        self.values = [torch.zeros(size, dtype=shape.dtype, device=self.device) for _ in range(shape.num_layers)]

    def block_slots(self, blocks: list[int]) -> torch.Tensor:
        """The slot indices of ``blocks``, block after block."""
        base = torch.tensor(blocks, dtype=torch.long, device=self.device).unsqueeze(1) * self.block_size
        return (base + torch.arange(self.block_size, device=self.device)).reshape(-1)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy every slot of block ``src`` to block ``dst`` for each pair, in every layer."""
        if not pairs:
            return
        src = self.block_slots([s for s, _ in pairs])
        dst = self.block_slots([d for _, d in pairs])
        for tensor in (*self.keys, *self.values):
            tensor.index_copy_(0, dst, tensor.index_select(0, src))


