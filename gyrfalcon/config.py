"""Server settings: one dataclass, filled from the command line or the environment."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field

from gyrfalcon.kernels.quant import QUANTIZATIONS
from gyrfalcon.engine_api.config import LOGPROBS_MODES, LoraConfig, SpeculativeConfig, parse_lora_module
from gyrfalcon.engine_api.lengths import default_request_tokens

#: Environment variable through which `gyrfalcon serve` hands its settings to gunicorn workers.
SETTINGS_ENV = "GYRFALCON_SETTINGS"
#: Environment variable naming the private file (mode 0600) that holds the API keys for the workers:
#: keys never travel in an environment, where child processes and /proc would see them.
API_KEYS_FILE_ENV = "GYRFALCON_API_KEYS_FILE"
#: Environment variable a user may set instead of ``--api-key`` (as vLLM's VLLM_API_KEY); `gyrfalcon
#: serve` takes it out of the environment it passes on.
API_KEY_ENV = "GYRFALCON_API_KEY"
#: the name with which the private API-keys file begins (the gunicorn master removes it at exit)
PRIVATE_KEYS_PREFIX = "gyrfalcon-keys-"


def read_api_keys(path: str) -> list[str]:
    """API keys from a file: one per line, blank lines and ``#`` comments ignored."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]

DTYPES = ("float32", "bfloat16", "float16", "auto")


def read_private_keys_file(path: str) -> list[str]:
    """The keys of a file ``gyrfalcon serve`` wrote (a JSON list: every key exactly as given)."""
    with open(path, encoding="utf-8") as f:
        return list(json.load(f))


def option(default=None, help: str = "", *, factory=None, type=None, flag: str | None = None, nargs: str | None = None,
           choices: tuple[str, ...] | None = None, action: str | None = None, group: str | None = None,
           checked: bool = False):
    """A :class:`Settings` field with its ``gyrfalcon serve`` option: the parser is derived from
    these (:func:`add_arguments`), so a new setting is written once, here.

    ``type``: the option's type where the default is None; ``flag``: where it is not
    ``--field-name``; ``action``: ``store_true``/``append`` (a bool is otherwise ``--x/--no-x``);
    ``choices``: the allowed values, refused by the parser, or with ``checked`` by
    :meth:`Settings.validate` in one line; ``group``: the ``--help`` section.
    """
    meta = {"help": help, "type": type, "flag": flag, "nargs": nargs, "choices": choices, "action": action,
            "group": group, "checked": checked}  # fmt: skip
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


RAY = "Ray Serve: engine replicas behind one endpoint (pip install 'gyrfalcon[ray]')"
LORA = "LoRA adapters: many fine-tunes of the base model in one batch (vLLM's flags)"


@dataclass
class Settings:
    """Everything a worker needs to build the app and its engine (vLLM's names where they exist);
    each field's option and help come with it (see :func:`option`)."""

    model: str | None = option(None, "a Hugging Face folder or a .gguf file (default: embedded SmolLM2-135M-Instruct)", type=str)
    served_model_name: list[str] = option(help="model names clients may ask for", factory=list, nargs="+")
    engine: str = option("transformers", "engine backend (from the installed plugins)")
    max_model_len: int | None = option(None, "context length (default: the model's)", type=int)
    max_num_seqs: int = option(16, "sequences decoded together (the running batch)")
    max_num_batched_tokens: int = option(4096, "most tokens of one step (prefill chunks and decode tokens)")
    max_queue_len: int = option(1024, "requests (prompts) waiting for the engine beyond those its free --max-num-seqs "
                                "seats take at the next step; beyond it a 503 with Retry-After")  # fmt: skip
    max_request_seqs: int = option(1024, "most sequences (prompts x n) one request may ask for; the choices beyond "
                                   "the running batch wait their turn")  # fmt: skip
    max_request_tokens: int | None = option(None, "most tokens one request may generate: prompts x n x max_tokens, "
                                            "a token with logprobs counting 1 + entries/20 (default: twice "
                                            "--max-num-seqs x the context)", type=int)  # fmt: skip
    max_logprobs: int = option(20, "most top logprobs a request may ask for")
    enable_rl_endpoints: bool = option(False, "serve the control routes RL trainers use: POST /pause, /resume, "
                                       "/inference/v1/abort_requests, /update_weights_from_disk, /sleep, /wake_up "
                                       "and GET /is_paused, /weight_version, /is_sleeping (behind the API key)")
    logprobs_mode: str = option("raw_logprobs", "what every returned logprob holds (sampled token, top, "
                                "logprob_token_ids, prompt): " + "; ".join(f"{k}: {v}" for k, v in LOGPROBS_MODES.items()),
                                choices=tuple(LOGPROBS_MODES), checked=True)  # fmt: skip
    speculative_config: str | None = option(None, "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", "
                                            "\"num_speculative_tokens\": k, \"prompt_lookup_min\": a, "
                                            "\"prompt_lookup_max\": b}, or {\"method\": \"draft_model\", \"model\": FOLDER, "
                                            "\"num_speculative_tokens\": k}; every token is the one the model's own step "
                                            "would give (off by default)", type=str)  # fmt: skip
    seed: int = option(0, "the engine's seed (unseeded requests draw theirs from it)")
    dtype: str = option("auto", "the model's dtype (auto: bfloat16 on cuda, float32 on cpu)", choices=DTYPES, checked=True)
    #: vLLM's --quantization
    quantization: str = option("auto", "weight-only kernels of the linear layers: auto (a GGUF keeps its 4-bit bits), "
                               "none, int4, int8", choices=QUANTIZATIONS, checked=True)  # fmt: skip
    #: docs/kernels.md: on the default model int8 inputs moved log-probabilities by 0.03 to 0.09 nats
    #: (the same kernels, last bits apart, land anywhere in that range), fp32 inputs by 0.0000
    matmul_inputs: str = option("auto", "CPU, int4 layers: float32 (our kernel: the fp32 weights' products exactly), "
                                "int16 (ours, inputs rounded to 15 bits per block of 32, in integers), int8 (ours, "
                                "inputs rounded per block of 32 as llama.cpp: the least arithmetic, furthest from the "
                                "fp32 model), bfloat16 (torch's kernel); auto: the fastest of those within the quality "
                                "bar on this CPU", choices=("auto", "float32", "int16", "int8", "bfloat16"), checked=True)  # fmt: skip
    device: str = option("auto", "auto (cuda where there is one, else cpu), cpu, cuda, cuda:N")
    #: vLLM's --kv-cache-dtype
    kv_cache_dtype: str = option("auto", "the KV cache's dtype: auto (the model's; float16 beside an fp32 model's "
                                 "quantised layers, as llama.cpp keeps a GGUF's), float32, bfloat16, float16 (the "
                                 "last two twice the tokens per byte)", choices=DTYPES, checked=True)  # fmt: skip
    block_size: int = option(16, "tokens per KV-cache block")
    kv_cache_memory: int | None = option(None, "bytes of KV cache (default: max-num-seqs full-length sequences, as "
                                         "memory allows; on the CPU at most one context of the model's length or "
                                         "8,192 tokens, whichever is more)", type=int)  # fmt: skip
    gpu_memory_utilization: float = option(0.9, "share of the GPU's memory to use, KV cache included (CUDA)")
    enable_prefix_caching: bool = option(True, "reuse the KV of equal prompt prefixes")
    enable_lora: bool = option(False, "serve LoRA adapters beside the base model (a request names one as its model)",
                               group=LORA)  # fmt: skip
    lora_modules: list[str] = option(help="adapters served from start-up, each NAME=PATH (a PEFT folder) or vLLM's JSON "
                                          "object {\"name\", \"path\", \"base_model_name\"}",
                                     factory=list, nargs="+", group=LORA)  # fmt: skip
    max_loras: int = option(1, "adapters requests run with at once (vLLM's; the slots are max(--max-loras, "
                                 "--max-cpu-loras); an adapter no slot holds is read back when a request needs it)",
                            group=LORA)  # fmt: skip
    max_lora_rank: int = option(16, "the largest rank an adapter may have", group=LORA)
    max_cpu_loras: int | None = option(None, "adapters kept in slots at once (vLLM's; default --max-loras)", type=int,
                                       group=LORA)  # fmt: skip
    enforce_eager: bool = option(False, "never capture or compile decode steps", action="store_true")
    #: On by default: on the default model it takes the batch-1 step from about 18 to 13 ms, and the
    #: compiled step serves only if it gives the eager step's logits to the last bit (checked at
    #: start-up), so a seeded request's tokens stay the same alone and in any batch. The compile
    #: (about 35 s the first time, less from inductor's cache) runs beside eager steps, so the
    #: server is ready as fast either way.
    compile_decode: bool = option(True, "CPU, where the decode step's layers are not int4 (those run in one call of "
                                  "decode_layers.c): compile the decode step of batches 1, 2, 4, 8 and 16, in the "
                                  "background from start-up (steps run eagerly until it is checked against the eager "
                                  "step, bit for bit, and found faster; --enforce-eager also turns it off)")  # fmt: skip
    #: vLLM's --model-impl
    model_impl: str = option("auto", "auto: the direct forward where the architecture has one (Llama, Mistral, Qwen2, "
                             "Qwen3; checked against transformers' at start-up), else transformers'; direct: refuse "
                             "a model without one; transformers: always transformers' forward",
                             choices=("auto", "direct", "transformers"))  # fmt: skip
    #: vLLM's --attention-backend (its names are kernels; ours say how the KV blocks are read)
    attention_backend: str = option("auto", "auto: flex on CUDA, gather elsewhere; flex: attention reads the KV blocks in "
                                    "place (torch's flex attention; checked against gather at start-up); gather: "
                                    "each sequence's blocks copied, then SDPA (the fastest on the CPU)",
                                    choices=("auto", "flex", "gather"))  # fmt: skip
    #: vLLM's --generation-config
    generation_config: str = option("auto", "auto: sampling defaults from the model's generation_config.json; none: "
                                    "the API's", choices=("auto", "none"))  # fmt: skip
    #: vLLM's --scheduling-policy
    scheduling_policy: str = option("fcfs", "fcfs: arrival order; priority: a request's priority field orders it "
                                    "(lower first)", choices=("fcfs", "priority"))  # fmt: skip
    #: Measured on the 2-core machine (bench, c=16): 2 threads gave 111.6 output tok/s against 93.5
    #: with 1, with the same time per token at c=1
    num_threads: int = option(2, "torch threads per worker")
    #: sized for max_request_seqs prompts of ~16 KB of text each
    max_body_bytes: int = option(16 * 1024 * 1024, "largest request body in bytes (a 413 beyond)")
    #: nginx's client_header_timeout
    client_header_timeout: float = option(20.0, "seconds a client has to send a request's headers (then a 408 and "
                                          "the connection closes)")  # fmt: skip
    client_body_timeout: float = option(60.0, "seconds a client has to send a request's body (then a 408)")
    #: nginx's send_timeout
    send_timeout: float = option(30.0, "seconds a response waits for a client that reads nothing (then the request "
                                 "is aborted)")  # fmt: skip
    #: what still runs after it ends with a 503 error (before any hard kill)
    drain_timeout: float = option(25.0, "seconds running requests may finish after SIGTERM (queued ones get a 503 at "
                                  "once)")  # fmt: skip
    #: more than one needs the engine in its own process
    api_workers: int = option(1, "API worker processes (HTTP, tokenizer, detokenizer); the engine has its own")
    #: reached by the API workers over ZeroMQ
    engine_process: bool = option(True, "run the engine in its own process (--no-engine-process: inside the one API "
                                  "worker)")  # fmt: skip
    #: a gyrfalcon_tool_parsers name; vLLM's --tool-call-parser
    tool_call_parser: str = option("hermes", "how the model writes tool calls: hermes (<tool_call>{json}</tool_call>), "
                                   "json, or a plugin's")  # fmt: skip
    api_keys: list[str] = option(help=f"a key clients must send as 'Authorization: Bearer <key>' (also ${API_KEY_ENV})",
                                 factory=list, flag="--api-key", action="append")  # fmt: skip
    allowed_origins: list[str] = option(help="CORS: origins browsers may call from ('*': any)", factory=list, nargs="*")
    metrics_require_key: bool = option(False, "/metrics asks for an API key too (off: public, as vLLM's)",
                                       action="store_true")  # fmt: skip
    ssl_keyfile: str | None = option(None, "TLS private key (PEM)", type=str)
    ssl_certfile: str | None = option(None, "TLS certificate (PEM)", type=str)
    #: :mod:`gyrfalcon.ray`: the API workers are then Ray Serve ingress replicas
    ray: bool = option(False, "serve on Ray Serve (a local Ray, or $RAY_ADDRESS's cluster); --api-workers is then "
                       "the number of ingress replicas", action="store_true", group=RAY)  # fmt: skip
    replicas: int = option(1, "engine replicas (the fewest, when autoscaling)", group=RAY)
    max_replicas: int | None = option(None, "autoscale up to this many engine replicas", type=int, group=RAY)
    target_ongoing_requests: float = option(8.0, "ongoing requests per replica the autoscaler aims at", group=RAY)
    upscale_delay_s: float = option(30.0, "seconds the autoscaler waits before adding replicas", group=RAY)
    downscale_delay_s: float = option(600.0, "seconds the autoscaler waits before removing replicas", group=RAY)
    replica_cpus: float = option(1.0, "CPUs per engine replica", group=RAY)
    replica_gpus: float | None = option(None, "GPUs per engine replica (default: 1 where the cluster has GPUs, else 0)",
                                        type=float, group=RAY)  # fmt: skip
    routing: str = option("prefix", "prefix: a prompt's prefix goes back to the replica that holds it, load allowing; "
                          "pow2: Ray Serve's power of two choices", choices=("prefix", "pow2"), group=RAY)  # fmt: skip
    responses_store_size: int = option(10000, "most responses the Responses API keeps (store: true); the oldest go first")
    responses_ttl: float = option(30 * 24 * 3600.0, "seconds a stored response is kept (default 30 days, as OpenAI)")
    plugins_allow: list[str] | None = option(None, "load only these plugins (default: every installed one)", type=str, nargs="*")
    plugins_block: list[str] = option(help="never load these plugins", factory=list, nargs="*")
    cache_dir: str | None = option(None, "where converted models and compiled code are kept (default: ~/.cache/gyrfalcon)", type=str)

    def validate(self) -> None:
        """Raise ValueError with one clear line for a bad setting."""
        positive = (
            "max_num_seqs", "max_num_batched_tokens", "max_queue_len", "max_request_seqs", "num_threads", "max_body_bytes",
            "block_size", "api_workers", "responses_store_size",
        )
        for name in (*positive, *(["max_request_tokens"] if self.max_request_tokens is not None else [])):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for key in self.api_keys:
            if not key.strip() or any(c in key for c in "\r\n") or key != key.strip():
                raise ValueError("an API key must be non-empty, without surrounding spaces or line breaks")
        for name in ("client_header_timeout", "client_body_timeout", "send_timeout", "drain_timeout", "responses_ttl"):
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
        if self.api_workers > 1 and not self.engine_process and not self.ray:
            raise ValueError("--api-workers above 1 needs the engine in its own process (drop --no-engine-process)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        SpeculativeConfig.parse(self.speculative_config)
        LoraConfig.of(self).check()
        for module in self.lora_modules or ():
            base = parse_lora_module(module)[2]
            if base is not None and base not in self.served_names():
                raise ValueError(f"--lora-modules: base_model_name {base!r} is not a served model "
                                 f"({', '.join(self.served_names())})")  # fmt: skip
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"--kv-cache-memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_logprobs < 0:
            raise ValueError(f"--max-logprobs must be at least 0, got {self.max_logprobs}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{_flag(f)} must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be in [0, 2**63), got {self.seed}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        for name in ("ssl_keyfile", "ssl_certfile"):
            if getattr(self, name) is not None and not os.path.isfile(getattr(self, name)):
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: no such file")
        if self.model is not None and not os.path.exists(self.model):
            raise ValueError(f"--model {self.model!r}: no such file or folder")

    def request_tokens(self, max_model_len: int) -> int:
        """The most work one request may ask for (``--max-request-tokens``, else its default for a
        context of ``max_model_len``)."""
        return self.max_request_tokens or default_request_tokens(self.max_num_seqs, max_model_len)

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add an option for every :class:`Settings` field, with its default, type and help."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(Settings):
        meta = f.metadata
        target: argparse.ArgumentParser | argparse._ArgumentGroup = parser
        if meta.get("group"):
            title, _, description = meta["group"].partition(": ")
            target = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title, description))
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kwargs: dict = {"dest": f.name, "default": default, "help": meta.get("help") or None}
        if meta.get("action"):
            kwargs["action"] = meta["action"]
        elif isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = meta.get("type") or (str if isinstance(default, list) else type(default))
            if meta.get("nargs"):
                kwargs["nargs"] = meta["nargs"]
            if meta.get("choices") and not meta.get("checked"):
                kwargs["choices"] = meta["choices"]
        target.add_argument(_flag(f), **kwargs)


def from_args(args: argparse.Namespace) -> Settings:
    """The settings a parsed command line holds (options that are no setting are left out)."""
    return Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Settings) if hasattr(args, f.name)})


def api_keys_from_env_and_file(key_file: str | None, env: dict[str, str] | None = None) -> list[str]:
    """``$GYRFALCON_API_KEY`` and the keys of ``key_file`` (``--api-key-file``); a file that was given
    but holds no key is an error, never a server without authentication."""
    env = os.environ if env is None else env
    keys = [env[API_KEY_ENV]] if API_KEY_ENV in env else []
    if key_file:
        from_file = read_api_keys(key_file)
        if not from_file:
            raise ValueError(f"--api-key-file {key_file!r} holds no key")
        keys.extend(from_file)
    return keys


def write_private_keys_file(keys: list[str]) -> str:
    """Write ``keys`` to a new file only this user can read (read back by
    :func:`read_private_keys_file`); its path. It lives as long as the server: workers that gunicorn
    restarts read it again."""
    fd, path = tempfile.mkstemp(prefix=PRIVATE_KEYS_PREFIX, text=True)  # mode 0600
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(keys, f)
    return path
