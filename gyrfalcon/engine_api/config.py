"""What an engine is built from: plain data, no server settings (the engine may live elsewhere)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


#: what every logprob the server returns holds (vLLM's ``--logprobs-mode``), each value's meaning
LOGPROBS_MODES: dict[str, str] = {
    "raw_logprobs": "the log-softmax of the model's logits, before any sampling parameter touches them",
    "processed_logprobs": "the log-softmax of the logits the token is drawn from: after penalties, bans, "
    "logit_bias, temperature, top-k, top-p and min-p (a token they exclude has the floor, -9999)",
    "raw_logits": "the model's logits themselves",
    "processed_logits": "the logits the token is drawn from, after every sampling parameter",
}


@dataclass(frozen=True)
class EngineConfig:
    """The engine's configuration, with vLLM's names; defaults live in the server's ``Settings``.

    ``model`` is a local Hugging Face folder (a GGUF is converted before the engine is built);
    ``max_model_len`` None means the model's own context length; ``kv_cache_memory`` None means
    enough blocks for ``max_num_seqs`` full-length sequences, as the device allows.
    """

    model: str
    dtype: str
    device: str
    quantization: str
    max_model_len: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_queue_len: int
    max_request_seqs: int
    max_logprobs: int
    seed: int
    num_threads: int
    block_size: int
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    enforce_eager: bool
    #: CPU: compile the small-batch decode step, in the background from start-up (checked against the eager one)
    compile_decode: bool = True
    generation_config: str = "auto"
    scheduling_policy: str = "fcfs"
    #: where compiled code is cached across starts (None: the default cache folder)
    cache_dir: str | None = None
    #: the KV cache's dtype (``auto``: the model's)
    kv_cache_dtype: str = "auto"
    #: ``auto``, ``direct`` or ``transformers``: which forward runs the model
    model_impl: str = "auto"
    #: ``auto``, ``flex`` or ``gather``: how attention reads the KV blocks
    attention_backend: str = "auto"
    #: ``auto``, ``float32`` or ``int8``: how the CPU's int4 layers read their inputs
    matmul_inputs: str = "auto"
    #: what the logprobs returned hold (:data:`LOGPROBS_MODES`)
    logprobs_mode: str = "raw_logprobs"

    @classmethod
    def from_settings(cls, settings: Any, model: str) -> EngineConfig:
        """The engine's share of the server's settings (same field names), serving ``model``."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "model"]
        return cls(model=str(model), **{name: getattr(settings, name) for name in names})
