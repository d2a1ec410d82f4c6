"""``gyrfalcon serve`` (and later ``gyrfalcon bench``): the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from gyrfalcon.config import API_KEY_ENV, API_KEYS_FILE_ENV, SETTINGS_ENV, Settings, read_api_keys


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model under gunicorn (OpenAI-compatible API)")
    p.add_argument("--model", default=None, help="a Hugging Face folder or a .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=[], help="model names clients may ask for")
    p.add_argument("--engine", default="transformers", help="engine backend (from the installed plugins)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=Settings.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=Settings.max_num_batched_tokens)
    p.add_argument("--max-queue-len", type=int, default=Settings.max_queue_len)
    p.add_argument("--max-request-seqs", type=int, default=Settings.max_request_seqs,
                   help="most sequences (prompts x n) one request may ask for")
    p.add_argument("--max-logprobs", type=int, default=Settings.max_logprobs)
    p.add_argument("--seed", type=int, default=Settings.seed)
    p.add_argument("--dtype", default=Settings.dtype, help="the model's dtype (auto: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--quantization", default=Settings.quantization,
                   help="weight-only kernels of the linear layers: auto (a GGUF keeps its 4-bit bits), none, int4, int8")
    p.add_argument("--device", default=Settings.device)
    p.add_argument("--num-threads", type=int, default=Settings.num_threads, help="torch threads per worker")
    p.add_argument("--kv-cache-dtype", default=Settings.kv_cache_dtype,
                   help="the KV cache's dtype: auto (the model's), float32, bfloat16 (twice the tokens per byte), float16")
    p.add_argument("--block-size", type=int, default=Settings.block_size, help="tokens per KV-cache block")
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes of KV cache (default: max-num-seqs full-length sequences, as memory allows)")
    p.add_argument("--gpu-memory-utilization", type=float, default=Settings.gpu_memory_utilization,
                   help="share of the GPU's memory to use, KV cache included (CUDA)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=Settings.enable_prefix_caching, help="reuse the KV of equal prompt prefixes")
    p.add_argument("--enforce-eager", action="store_true", help="never capture or compile decode steps")
    p.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=Settings.compile_decode,
                   help="CPU: compile the batch-1 decode step at start-up (about 35 s on the default model), "
                        "checked against the eager step")
    p.add_argument("--generation-config", default=Settings.generation_config, choices=("auto", "none"),
                   help="auto: sampling defaults from the model's generation_config.json; none: the API's")
    p.add_argument("--scheduling-policy", default=Settings.scheduling_policy, choices=("fcfs", "priority"),
                   help="fcfs: arrival order; priority: a request's priority field orders it (lower first)")
    p.add_argument("--max-body-bytes", type=int, default=Settings.max_body_bytes)
    p.add_argument("--client-header-timeout", type=float, default=Settings.client_header_timeout,
                   help="seconds a client has to send a request's headers (then a 408 and the connection closes)")
    p.add_argument("--client-body-timeout", type=float, default=Settings.client_body_timeout,
                   help="seconds a client has to send a request's body (then a 408)")
    p.add_argument("--send-timeout", type=float, default=Settings.send_timeout,
                   help="seconds a response waits for a client that reads nothing (then the request is aborted)")
    p.add_argument("--drain-timeout", type=float, default=Settings.drain_timeout,
                   help="seconds running requests may finish after SIGTERM (queued ones get a 503 at once)")
    p.add_argument("--api-workers", type=int, default=Settings.api_workers,
                   help="API worker processes (HTTP, tokenizer, detokenizer); the engine has its own")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=Settings.engine_process,
                   help="run the engine in its own process (--no-engine-process: inside the one API worker)")
    ray = p.add_argument_group("Ray Serve", "engine replicas behind one endpoint (pip install 'gyrfalcon[ray]')")
    ray.add_argument("--ray", action="store_true", help="serve on Ray Serve (a local Ray, or $RAY_ADDRESS's cluster); "
                     "--api-workers is then the number of ingress replicas")  # fmt: skip
    ray.add_argument("--replicas", type=int, default=Settings.replicas, help="engine replicas (the fewest, when autoscaling)")
    ray.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many engine replicas")
    ray.add_argument("--target-ongoing-requests", type=float, default=Settings.target_ongoing_requests,
                     help="ongoing requests per replica the autoscaler aims at")
    ray.add_argument("--upscale-delay-s", type=float, default=Settings.upscale_delay_s)
    ray.add_argument("--downscale-delay-s", type=float, default=Settings.downscale_delay_s)
    ray.add_argument("--replica-cpus", type=float, default=Settings.replica_cpus, help="CPUs per engine replica")
    ray.add_argument("--replica-gpus", type=float, default=None,
                     help="GPUs per engine replica (default: 1 where the cluster has GPUs, else 0)")
    ray.add_argument("--routing", default=Settings.routing, choices=("prefix", "pow2"),
                     help="prefix: a prompt's prefix goes back to the replica that holds it, load allowing; "
                     "pow2: Ray Serve's power of two choices")  # fmt: skip
    p.add_argument("--tool-call-parser", default=Settings.tool_call_parser,
                   help="how the model writes tool calls: hermes (<tool_call>{json}</tool_call>), json, or a plugin's")
    p.add_argument("--api-key", action="append", default=[], dest="api_keys",
                   help=f"a key clients must send as 'Authorization: Bearer <key>' (also ${API_KEY_ENV})")
    p.add_argument("--api-key-file", default=None, help="a file of API keys, one per line")
    p.add_argument("--allowed-origins", nargs="*", default=[], help="CORS: origins browsers may call from ('*': any)")
    p.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    p.add_argument("--ssl-certfile", default=None, help="TLS certificate (PEM)")
    p.add_argument("--plugins-allow", nargs="*", default=None)
    p.add_argument("--plugins-block", nargs="*", default=[])
    p.add_argument("--cache-dir", default=None)


def _keys_from_env_and_file(args: argparse.Namespace) -> list[str]:
    """``$GYRFALCON_API_KEY`` and the keys of ``--api-key-file``; a file or variable that was given
    but holds no key is an error, never a server without authentication."""
    keys = []
    if API_KEY_ENV in os.environ:
        keys.append(os.environ[API_KEY_ENV])
    if args.api_key_file:
        from_file = read_api_keys(args.api_key_file)
        if not from_file:
            raise ValueError(f"--api-key-file {args.api_key_file!r} holds no key")
        keys.extend(from_file)
    return keys


def private_keys_file(keys: list[str]) -> str:
    """Write ``keys`` to a new file only this user can read; its path (the server's lifetime: workers
    that gunicorn restarts read it again)."""
    fd, path = tempfile.mkstemp(prefix="gyrfalcon-keys-", text=True)  # mode 0600
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(keys, f)
    return path


#: prometheus-client's multiprocess directory: every API worker writes its request metrics there
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: prefix of the directory `gyrfalcon serve` makes when the user names none (removed at exit)
METRICS_DIR_PREFIX = "gyrfalcon-metrics-"


def metrics_dir(env: dict[str, str]) -> str:
    """The multiprocess metrics directory for a new server: the user's (``$PROMETHEUS_MULTIPROC_DIR``),
    cleared of an earlier server's files, or a new private one."""
    path = env.get(METRICS_DIR_ENV)
    if not path:
        return tempfile.mkdtemp(prefix=METRICS_DIR_PREFIX)
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if name.endswith(".db"):  # counts of a server that is gone would be added to ours
            os.unlink(os.path.join(path, name))
    return path


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    from gyrfalcon.bench.run import add_arguments

    add_arguments(sub.add_parser("bench", help="load-test a server and compare with the bare torch loop"))


def _check_parser(sub: argparse._SubParsersAction) -> None:
    from gyrfalcon.check.cli import add_arguments

    add_arguments(sub.add_parser("check", help="check an OpenAI-compatible server against the contract"))


def settings_from_args(args: argparse.Namespace) -> Settings:
    names = {f for f in Settings.__dataclass_fields__}
    return Settings(**{k: v for k, v in vars(args).items() if k in names})


def serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    try:
        settings.api_keys = [*settings.api_keys, *_keys_from_env_and_file(args)]
        settings.validate()
    except (ValueError, OSError) as exc:
        print(f"gyrfalcon: {exc}", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"gyrfalcon: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    from gyrfalcon.models.default import resolve_model
    from gyrfalcon.plugins import merged_dict, plugin_manager

    try:
        pm = plugin_manager(settings.plugins_allow, settings.plugins_block)
        engines = merged_dict(pm.hook.gyrfalcon_engines(), "engine")
        parsers = merged_dict(pm.hook.gyrfalcon_tool_parsers(), "tool-call parser")
    except Exception as exc:  # a broken plugin must not start a half-working server
        print(f"gyrfalcon: plugins: {exc}", file=sys.stderr)
        return 2
    if settings.engine not in engines:
        print(f"gyrfalcon: --engine {settings.engine!r} is not installed; available: {', '.join(sorted(engines))}", file=sys.stderr)
        return 2
    if settings.tool_call_parser not in parsers:
        print(f"gyrfalcon: --tool-call-parser {settings.tool_call_parser!r} is not installed; available: "
              f"{', '.join(sorted(parsers))}", file=sys.stderr)  # fmt: skip
        return 2

    settings.served_model_name = settings.served_names()  # named after what the user gave, not the cache
    # Convert a GGUF (or the embedded default) before gunicorn forks: never in two workers at once.
    settings.model = resolve_model(settings.model, settings.cache_dir)
    if settings.ray:
        from gyrfalcon.ray.app import serve_forever

        return serve_forever(settings, args.host, args.port)
    env = dict(os.environ)
    env[SETTINGS_ENV] = settings.to_env()
    env.pop(API_KEY_ENV, None)  # never passed on: the workers read the keys from a private file
    if settings.api_keys:
        env[API_KEYS_FILE_ENV] = private_keys_file(settings.api_keys)
    env[METRICS_DIR_ENV] = metrics_dir(env)
    env.setdefault("MALLOC_ARENA_MAX", "2")
    env.setdefault("HF_HUB_OFFLINE", "1")
    argv = [
        sys.executable, "-m", "gunicorn",
        "-c", "python:gyrfalcon.gunicorn_conf",
        "--bind", f"{args.host}:{args.port}",
        *(["--keyfile", settings.ssl_keyfile, "--certfile", settings.ssl_certfile] if settings.ssl_certfile else []),
        "gyrfalcon.api.app:asgi_app()",
    ]
    argv[argv.index("--bind"):argv.index("--bind")] = ["--workers", str(settings.api_workers)]
    scheme = "https" if settings.ssl_certfile else "http"
    print(f"gyrfalcon: serving {settings.model} on {scheme}://{args.host}:{args.port}", file=sys.stderr, flush=True)
    if settings.engine_process:  # this process becomes the launcher: engine process, then gunicorn
        argv = [sys.executable, "-m", "gyrfalcon.engine_process.launch", *argv]
    os.execve(sys.executable, argv, env)
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyrfalcon", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _bench_parser(sub)
    _check_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "bench":
        from gyrfalcon.bench.run import main as bench

        return bench(args)
    if args.command == "check":
        from gyrfalcon.check.cli import main as check

        return check(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
