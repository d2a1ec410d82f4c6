"""Server settings: one dataclass, filled from the command line or the environment."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

#: Environment variable through which `gyrfalcon serve` hands its settings to gunicorn workers.
SETTINGS_ENV = "GYRFALCON_SETTINGS"
#: Environment variable naming the private file (mode 0600) that holds the API keys for the workers:
#: keys never travel in an environment, where child processes and /proc would see them.
API_KEYS_FILE_ENV = "GYRFALCON_API_KEYS_FILE"
#: Environment variable a user may set instead of ``--api-key`` (as vLLM's VLLM_API_KEY); `gyrfalcon
#: serve` takes it out of the environment it passes on.
API_KEY_ENV = "GYRFALCON_API_KEY"


def read_api_keys(path: str) -> list[str]:
    """API keys from a file: one per line, blank lines and ``#`` comments ignored."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]

DTYPES = ("float32", "bfloat16", "float16", "auto")


def read_private_keys_file(path: str) -> list[str]:
    """The keys of a file ``gyrfalcon serve`` wrote (a JSON list: every key exactly as given)."""
    with open(path, encoding="utf-8") as f:
        return list(json.load(f))


@dataclass
class Settings:
    """Everything a worker needs to build the app and its engine (vLLM's names where they exist)."""

    model: str | None = None  # a Hugging Face folder or a .gguf file; None: the embedded default
    served_model_name: list[str] = field(default_factory=list)
    engine: str = "transformers"
    max_model_len: int | None = None  # None: the model's own context length
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 4096
    #: requests (prompts) waiting for the engine; beyond it a 503 with Retry-After
    max_queue_len: int = 1024
    #: most sequences (prompts × n) one request may ask for, vLLM's cap on prompts per request; the
    #: choices beyond the running batch (max_num_seqs) wait their turn
    max_request_seqs: int = 1024
    max_logprobs: int = 20
    seed: int = 0
    dtype: str = "auto"  # bf16 on CUDA, fp32 on CPU
    #: weight-only kernels of the linear layers (vLLM's --quantization): auto (a GGUF keeps its
    #: 4-bit bits where the device computes them fast, other checkpoints their dtype), none, int4, int8
    quantization: str = "auto"
    device: str = "auto"
    #: the KV cache's dtype (vLLM's --kv-cache-dtype): auto (the model's), float32, bfloat16, float16
    kv_cache_dtype: str = "auto"
    #: tokens per KV block
    block_size: int = 16
    #: bytes of KV cache (None: enough for max_num_seqs full-length sequences, as the device allows)
    kv_cache_memory: int | None = None
    #: share of the GPU's memory the server may use (weights, activations and KV cache)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    #: never capture or compile decode steps (CUDA graphs, --compile-decode); every step runs eagerly
    enforce_eager: bool = False
    #: CPU: compile the batch-1 decode step with torch.compile at start-up, checked against the
    #: eager step. Off by default: on the default model it takes its step from 27 to 17 ms but adds
    #: about 35 s to every start (inductor's cache spares the compile, not dynamo's tracing)
    compile_decode: bool = False
    #: "auto": the model's generation_config.json gives the sampling defaults of the fields a client
    #: leaves unset (vLLM's --generation-config); "none": the API's own defaults
    generation_config: str = "auto"
    #: "fcfs": requests run in arrival order; "priority": a request's ``priority`` orders them
    #: (lower first) and non-zero priorities are accepted (vLLM's --scheduling-policy)
    scheduling_policy: str = "fcfs"
    #: torch threads per worker (CPU). Measured on the 2-core machine (bench, c=16): 2 threads gave
    #: 111.6 output tok/s against 93.5 with 1, with the same time per token at c=1
    num_threads: int = 2
    #: sized for max_request_seqs prompts of ~16 KB of text each
    max_body_bytes: int = 16 * 1024 * 1024
    #: seconds a client has to send a request's line and headers (nginx's client_header_timeout); a
    #: connection that takes longer is closed with a 408
    client_header_timeout: float = 20.0
    #: seconds a client has to send a request's body once its headers are in (a 408)
    client_body_timeout: float = 60.0
    #: seconds a response may wait for a client that reads nothing (nginx's send_timeout): the
    #: connection is then dropped and its request aborted
    send_timeout: float = 30.0
    #: seconds running requests may finish after SIGTERM: queued ones get a 503 at once, new ones
    #: are refused, and what still runs after this ends with a 503 error (before any hard kill)
    drain_timeout: float = 25.0
    #: gunicorn workers serving the API (each with its own tokenizer and detokenizers); more than
    #: one needs the engine in its own process
    api_workers: int = 1
    #: the engine runs in a process of its own, reached by the API workers over ZeroMQ (False: in
    #: the one API worker, for tests and small deployments)
    engine_process: bool = True
    #: how the model writes tool calls (a ``gyrfalcon_tool_parsers`` name; vLLM's --tool-call-parser)
    tool_call_parser: str = "hermes"
    api_keys: list[str] = field(default_factory=list)
    #: origins a browser may call the API from (CORS; "*" for any); empty: no CORS headers
    allowed_origins: list[str] = field(default_factory=list)
    #: TLS: the server's private key and certificate (PEM); both or neither
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    #: Ray Serve (``--ray``, :mod:`gyrfalcon.ray`): engine replicas behind one endpoint, the API
    #: workers being Ray Serve ingress replicas
    ray: bool = False
    #: engine replicas (with ``max_replicas``: the fewest the autoscaler keeps)
    replicas: int = 1
    #: autoscale between ``replicas`` and this many by ongoing requests; None: a fixed count
    max_replicas: int | None = None
    #: the ongoing requests per replica the autoscaler aims at
    target_ongoing_requests: float = 8.0
    #: seconds the autoscaler waits before adding or removing replicas
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    #: resources each engine replica asks Ray for; GPUs None: one per replica where the cluster has
    #: GPUs, none elsewhere
    replica_cpus: float = 1.0
    replica_gpus: float | None = None
    #: how requests pick their replica: prefix (affinity to the replica holding the prompt's
    #: prefix, load allowing) or pow2 (Ray Serve's power of two choices)
    routing: str = "prefix"
    plugins_allow: list[str] | None = None  # None: every installed plugin
    plugins_block: list[str] = field(default_factory=list)
    cache_dir: str | None = None

    def validate(self) -> None:
        """Raise ValueError with one clear line for a bad setting."""
        positive = (
            "max_num_seqs", "max_num_batched_tokens", "max_queue_len", "max_request_seqs", "num_threads", "max_body_bytes",
            "block_size", "api_workers",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for key in self.api_keys:
            if not key.strip() or any(c in key for c in "\r\n") or key != key.strip():
                raise ValueError("an API key must be non-empty, without surrounding spaces or line breaks")
        for name in ("client_header_timeout", "client_body_timeout", "send_timeout", "drain_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {getattr(self, name)}")
        if self.replicas < 1 or (self.max_replicas is not None and self.max_replicas < self.replicas):
            raise ValueError(f"--replicas must be at least 1 and at most --max-replicas, got {self.replicas}")
        for name in ("target_ongoing_requests", "replica_cpus"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 0, got {getattr(self, name)}")
        if self.replica_gpus is not None and self.replica_gpus < 0:
            raise ValueError(f"--replica-gpus must be at least 0, got {self.replica_gpus}")
        if self.routing not in ("prefix", "pow2"):
            raise ValueError(f"--routing must be prefix or pow2, got {self.routing!r}")
        if self.api_workers > 1 and not self.engine_process and not self.ray:
            raise ValueError("--api-workers above 1 needs the engine in its own process (drop --no-engine-process)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"--kv-cache-memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_logprobs < 0:
            raise ValueError(f"--max-logprobs must be at least 0, got {self.max_logprobs}")
        if self.generation_config not in ("auto", "none"):
            raise ValueError(f"--generation-config must be auto or none, got {self.generation_config!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}")
        from gyrfalcon.engine.model.quant import QUANTIZATIONS

        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(DTYPES)}, got {self.kv_cache_dtype!r}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be in [0, 2**63), got {self.seed}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        for name in ("ssl_keyfile", "ssl_certfile"):
            if getattr(self, name) is not None and not os.path.isfile(getattr(self, name)):
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: no such file")
        if self.model is not None and not os.path.exists(self.model):
            raise ValueError(f"--model {self.model!r}: no such file or folder")

    @property
    def max_request_prompts(self) -> int:
        """Most prompts (or conversations) per request: each takes a place in the engine's queue."""
        return min(self.max_queue_len, self.max_request_seqs)

    def served_names(self) -> list[str]:
        """Model names clients may ask for: ``--served-model-name``, else the model's own name."""
        if self.served_model_name:
            return list(self.served_model_name)
        if self.model is None:
            from gyrfalcon.models.default import DEFAULT_NAME

            return [DEFAULT_NAME]
        return [os.path.basename(os.path.normpath(self.model)).removesuffix(".gguf")]

    def to_env(self) -> str:
        """The settings for the workers' environment, without the API keys (see :data:`API_KEYS_FILE_ENV`)."""
        return json.dumps({**dataclasses.asdict(self), "api_keys": []})

    @classmethod
    def from_env(cls) -> Settings:
        raw = os.environ.get(SETTINGS_ENV)
        settings = cls(**json.loads(raw)) if raw else cls()
        keys_file = os.environ.get(API_KEYS_FILE_ENV)
        if keys_file:
            settings.api_keys = read_private_keys_file(keys_file)
        return settings
