"""What an engine is built from: plain data, no server settings (the engine may live elsewhere)."""

from __future__ import annotations

import dataclasses
import json
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
class SpeculativeConfig:
    """``--speculative-config`` (vLLM's JSON shape): draft tokens proposed by ``method`` and
    verified by the model. ``ngram``: the tokens that followed the latest earlier occurrence of the
    sequence's trailing n-gram of ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens;
    ``draft_model``: the greedy tokens of a smaller model (``model``, a local folder) with the
    served model's tokenizer."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None

    #: the methods built, what they propose, and the fields each takes beside ``method``
    METHODS = {"ngram": "prompt lookup: the tokens that followed the trailing n-gram's latest earlier occurrence",
               "draft_model": "a smaller model's greedy tokens (same tokenizer)"}  # fmt: skip
    FIELDS = {"ngram": ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"),
              "draft_model": ("num_speculative_tokens", "model")}  # fmt: skip

    @classmethod
    def parse(cls, text: str | None) -> SpeculativeConfig | None:
        """The config of ``text`` (None: speculation off); a ValueError of one line otherwise."""
        if text is None or not text.strip():
            return None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--speculative-config must be a JSON object: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("--speculative-config must be a JSON object")
        method = data.get("method")
        if method not in cls.METHODS:
            raise ValueError(f"--speculative-config: method {method!r} is not served (built: {', '.join(cls.METHODS)})")
        unknown = sorted(set(data) - {"method", *cls.FIELDS[method]})
        if unknown:
            raise ValueError(f"--speculative-config: {unknown[0]!r} is not a field of the {method} method")
        counts = {name: data.get(name, default) for name, default in
                  (("num_speculative_tokens", None), ("prompt_lookup_min", 1), ("prompt_lookup_max", 4))}  # fmt: skip
        for name, value in counts.items():
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
                raise ValueError(f"--speculative-config: {name} must be an integer from 1 to 64, got {value!r}")
        if counts["prompt_lookup_min"] > counts["prompt_lookup_max"]:
            raise ValueError("--speculative-config: prompt_lookup_min must not exceed prompt_lookup_max")
        model = data.get("model")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError("--speculative-config: the draft_model method needs model, a local model folder")
        return cls(method, **counts, model=model)

    def describe(self) -> str:
        """For the start-up line and ``/health``."""
        if self.method == "draft_model":
            return f"draft_model (up to {self.num_speculative_tokens} draft tokens from {self.model})"
        return (f"{self.method} (up to {self.num_speculative_tokens} draft tokens, n-grams of "
                f"{self.prompt_lookup_min} to {self.prompt_lookup_max})")  # fmt: skip


def parse_lora_module(module: str) -> tuple[str, str, str | None]:
    """One ``--lora-modules`` value in either of vLLM's forms, ``NAME=PATH`` or the JSON object
    ``{"name": …, "path": …, "base_model_name": …}`` (the last optional): ``(name, path,
    base_model_name)``; a ValueError of one line otherwise."""
    if module.lstrip().startswith("{"):
        try:
            fields = json.loads(module)
        except ValueError as exc:
            raise ValueError(f"--lora-modules: {module!r} is not a JSON object: {exc}") from None
        unknown = sorted(set(fields) - {"name", "path", "base_model_name"}) if isinstance(fields, dict) else []
        if unknown:
            raise ValueError(f"--lora-modules: {', '.join(unknown)} not served (name, path, base_model_name are)")
        if not isinstance(fields, dict) or not all(isinstance(fields.get(k), str) and fields[k] for k in ("name", "path")):
            raise ValueError(f"--lora-modules: {module!r} needs a name and a path (strings)")
        base = fields.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules: base_model_name must be a string, got {base!r}")
        return fields["name"], fields["path"], base
    name, sep, path = module.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {module!r} is not NAME=PATH nor a JSON object")
    return name, path, None


#: the largest --max-lora-rank (vLLM's; ``lora_add.c``'s MAX_RANK)
MAX_LORA_RANK = 512


@dataclass(frozen=True)
class LoraConfig:
    """vLLM's LoRA flags: ``enable_lora``, the adapters served from start-up (``lora_modules``,
    :func:`parse_lora_module`'s forms), the largest rank (``max_lora_rank``), and the slots the
    adapters requests run with take: ``max(max_loras, max_cpu_loras)`` (vLLM's ``max_loras`` bounds
    the adapters of one batch and its ``max_cpu_loras`` those cached beside; here every slot serves
    every step, and an adapter no slot holds is read back from its folder when a request needs it)."""

    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @classmethod
    def of(cls, config: Any) -> LoraConfig:
        """The LoRA share of the server's settings or an :class:`EngineConfig` (same names)."""
        cpu = getattr(config, "max_cpu_loras", None)
        return cls(bool(config.enable_lora), tuple(config.lora_modules or ()), int(config.max_loras),
                   int(config.max_lora_rank), None if cpu is None else int(cpu))  # fmt: skip

    def modules(self) -> dict[str, str]:
        """The adapters to load at start-up, by name (``check`` first)."""
        return {name: path for name, path, _ in map(parse_lora_module, self.lora_modules)}

    def check(self) -> None:
        """A ValueError of one line for flags that cannot serve."""
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"--max-loras and --max-lora-rank must be at least 1, got {self.max_loras} and "
                             f"{self.max_lora_rank}")  # fmt: skip
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"--max-lora-rank must be at most {MAX_LORA_RANK} (vLLM's largest), got {self.max_lora_rank}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        names = [parse_lora_module(module)[0] for module in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError("--lora-modules: an adapter name is given twice")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras ({self.max_loras})")


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
    #: ``--speculative-config``'s JSON (:class:`SpeculativeConfig`; None: off)
    speculative_config: str | None = None
    #: LoRA adapters (:class:`LoraConfig`)
    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @classmethod
    def from_settings(cls, settings: Any, model: str) -> EngineConfig:
        """The engine's share of the server's settings (same field names), serving ``model``."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "model"]
        return cls(model=str(model), **{name: getattr(settings, name) for name in names})
