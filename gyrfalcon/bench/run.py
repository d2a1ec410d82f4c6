"""``gyrfalcon bench``: load runs against a server, the ceilings, n = 8 and memory checks, on a CPU or a GPU.

Workload (defaults follow the project's targets): 32-token prompts, temperature 0, ``ignore_eos``,
128 output tokens, at concurrency 1, 4 and 16 on a CPU (64 requests each) or 1, 16 and 64 on a GPU
(max(16, 2 × concurrency) requests each, so that one GPU run stays under 8 minutes), each level on
prompts no earlier request sent (so no level is served from a cache the one before filled); then one
n = 8 request against 8 sequential n = 1 requests; then, on a CPU, the worker's RSS before and
after 1,000 mixed requests; finally, with the server stopped (``--launch``) or idle, the ceilings in
this process on the same device and dtype, on the warm-up's prompts: the eager loop, and on a GPU the compiled
static-cache loop; on a CPU also the fp32 eager loop without quantisation, the baseline of the
targets. ``--peer-url URL`` runs the same loads against another OpenAI-compatible server (a llama.cpp
server on the same GGUF) in the same run and prints each level's ratio; ``--peer-serve-args ARGS``
launches the peer as the same server with more options (speculation on, against it off). ``--launch`` starts ``gyrfalcon serve`` on a free port and stops it again;
``--random-weights CONFIG.json`` benchmarks a model of that shape with random weights, built first.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from gyrfalcon.bench.ceiling import run_ceilings
from gyrfalcon.bench.client import Client, run_load, say, spec_counts, spec_note
from gyrfalcon.bench.workloads import WORKLOADS, level_prompts
from gyrfalcon.config import Settings
from gyrfalcon.kernels.quant import QUANTIZATIONS

MAX_CONCURRENCY = 128
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
#: a warm-up request taking longer than this means the server is stuck, not slow
WARM_UP_TIMEOUT_S = 300.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    p.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:8000 (or use --launch)")
    p.add_argument("--launch", action="store_true", help="start `gyrfalcon serve` for the run, stop it before the ceilings")
    p.add_argument("--model", default=None, help="model folder or .gguf for --launch and the ceilings (default: embedded)")
    p.add_argument("--random-weights", metavar="CONFIG.json", default=None,
                   help="build a model of this Hugging Face config's shape with random weights and benchmark it")  # fmt: skip
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="tokenizer folder for --random-weights (default: the embedded default model's)")  # fmt: skip
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cuda, cpu: server and ceilings")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                   help="the launched server's and the eager ceiling's weight kernels (serve's --quantization)")
    p.add_argument("--peer-url", default=None, metavar="URL",
                   help="another OpenAI-compatible server (llama.cpp's llama-server on the same GGUF, built on this "
                        "machine: docs/benchmarks.md): the same loads in the same run, ratios printed")  # fmt: skip
    p.add_argument("--peer-serve-args", default=None, metavar="ARGS",
                   help="with --launch, the peer is a second `gyrfalcon serve` of the same model with --serve-args "
                        "and these options: --peer-serve-args \"--speculative-config '{…}'\" measures the server "
                        "with and without them in one run, the same prompts' token ids to both")  # fmt: skip
    p.add_argument("--peer-api-key", default=None)
    p.add_argument("--peer-threads", type=int, default=None,
                   help="the threads the peer runs with (its -t), for the header: a server does not say")  # fmt: skip
    p.add_argument("--serve-args", default="", metavar="ARGS",
                   help='more `gyrfalcon serve` options for --launch, one string (split like a shell would): '
                        '--serve-args "--max-num-batched-tokens 8192"; one option alone: --serve-args=--enforce-eager')  # fmt: skip
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", default="random", choices=WORKLOADS,
                   help="random: prompts of random token ids; edit: chat prompts asking to write a passage out "
                        "again with one word replaced (what copies from the prompt)")  # fmt: skip
    p.add_argument("--prompt-tokens", type=int, default=32, help="random workload: the prompts' length")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=None,
                   help="requests per concurrency level (default: 64 on cpu, max(16, 2 x concurrency) on cuda)")  # fmt: skip
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help=f"concurrency levels, each 1..{MAX_CONCURRENCY} (default: 1 4 16 on cpu, 1 16 64 on cuda)")  # fmt: skip
    p.add_argument("--n", type=int, default=8, help="choices for the n vs sequential comparison (0: skip)")
    p.add_argument("--mixed", type=int, default=None,
                   help="mixed requests for the memory check (0: skip; default: 1000 on cpu, 0 on cuda)")  # fmt: skip
    p.add_argument("--no-ceiling", action="store_true", help="skip both ceilings")
    p.add_argument("--compiled-ceiling", action=argparse.BooleanOptionalAction, default=None,
                   help="the static-cache torch.compile loop (default: on cuda only)")  # fmt: skip
    p.add_argument("--num-threads", type=int, default=Settings.num_threads,
                   help="torch threads of the launched server and of the ceilings (default: the server's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-seed", type=int, default=secrets.randbelow(1 << 31),
                   help="the prompts' seed (default: a new one each run, printed in the header: a peer that "
                        "outlives a run keeps its prompts cached, and the same prompts again would measure that cache)")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--plot", default=None, metavar="FILE.svg", help="also draw output tok/s per level (and the peer's)")


def resolve_options(args: argparse.Namespace, device: str) -> str | None:
    """Fill the device-dependent defaults of ``args`` in place; an error message for a bad combination, else None."""
    cuda = device.startswith("cuda")
    if args.concurrency is None:
        args.concurrency = [1, 16, 64] if cuda else [1, 4, 16]
    if args.mixed is None:
        args.mixed = 0 if cuda else 1000
    if args.compiled_ceiling is None:
        args.compiled_ceiling = cuda
    if not args.url and not args.launch:
        return "give --url or --launch"
    if args.url and args.launch:
        return "give --url or --launch, not both"
    if bad := [c for c in args.concurrency if not 1 <= c <= MAX_CONCURRENCY]:
        return f"--concurrency must be in 1..{MAX_CONCURRENCY}, got {bad[0]}"
    if args.requests is not None and args.requests < 1:
        return f"--requests must be at least 1, got {args.requests}"
    if args.output_tokens < 2:
        return f"--output-tokens must be at least 2 (time per output token), got {args.output_tokens}"
    if args.prompt_tokens < 1:
        return f"--prompt-tokens must be at least 1, got {args.prompt_tokens}"
    if args.mixed < 0 or args.n < 0:
        return "--mixed and --n must be at least 0"
    if args.random_weights and args.model:
        return "give --model or --random-weights, not both"
    if args.random_weights and not os.path.exists(args.random_weights):
        return f"--random-weights {args.random_weights!r}: no such file"
    if args.tokenizer and not args.random_weights:
        return "--tokenizer goes with --random-weights"
    if args.peer_serve_args is not None and (not args.launch or args.peer_url):
        return "--peer-serve-args goes with --launch, and not with --peer-url"
    return None


def requests_at(args: argparse.Namespace, concurrency: int, device: str) -> int:
    """Requests of one level: ``--requests``, else 64 on CPU and max(16, 2 × concurrency) on CUDA."""
    if args.requests is not None:
        return args.requests
    return max(16, 2 * concurrency) if device.startswith("cuda") else 64


def _vocab(model_path: str) -> int:
    """Token ids every part accepts: below both the model's vocabulary and the tokenizer's size."""
    from transformers import AutoConfig, AutoTokenizer

    vocab = int(AutoConfig.from_pretrained(model_path, local_files_only=True).get_text_config(decoder=True).vocab_size)
    try:
        return min(vocab, len(AutoTokenizer.from_pretrained(model_path, local_files_only=True)))
    except (OSError, ValueError):
        return vocab


def _completion(model: str, prompt: list[int] | str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **extra}


def n_comparison(client: Client, model: str, prompt: list[int], n: int, max_tokens: int) -> dict[str, float]:
    """Seconds for one n-choice request against n sequential single-choice requests (same params)."""
    params = {"temperature": 1.0, "seed": 1, "ignore_eos": True, "max_tokens": max_tokens, "model": model, "prompt": prompt}
    start = time.perf_counter()
    status, body = client.post_json("/v1/completions", {**params, "n": n})
    together = time.perf_counter() - start
    if status != 200 or len(body["choices"]) != n:
        raise RuntimeError(f"n={n} request failed: {status} {str(body)[:200]}")
    start = time.perf_counter()
    for i in range(n):
        status, body = client.post_json("/v1/completions", {**params, "seed": 1 + i})
        if status != 200:
            raise RuntimeError(f"n=1 request failed: {status} {str(body)[:200]}")
    sequential = time.perf_counter() - start
    return {"n": n, "n_request_s": together, "sequential_s": sequential, "ratio": together / sequential}


def warm_up(client: Client, model: str, prompts: list[list[int]], top: int, server=None) -> None:
    """Two short requests, then ``top`` at once; raise RuntimeError (with the server's log) if any fails or hangs."""
    for load in (run_load(client, [_completion(model, prompts[0], 8)] * 2, 1),
                 run_load(client, [_completion(model, prompts[i], 8) for i in range(top)], top)):  # fmt: skip
        if load.errors:
            error = next(r.error for r in load.results if r.error is not None)
            log = f"; the end of its log:\n{server.log_tail()}" if server is not None else ""
            raise RuntimeError(f"warm-up request failed: {error}{log}")


def run_peer(args: argparse.Namespace, model_path: str, warm: list[list[int]], levels: list[list[list[int]]]):
    """The same loads against ``--peer-url`` (its first model), level by level. The prompts go as
    their text (decoded with the model's tokenizer), since not every server takes token ids
    (llama.cpp's Python server does not), and a peer on the same model tokenises them back to the
    same length; as their token ids to a peer of ``--peer-serve-args``."""
    from gyrfalcon.models.loading import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    as_sent = (lambda ids: ids) if args.peer_serve_args is not None else tokenizer.decode
    peer = Client(args.peer_url, args.peer_api_key)
    name = peer.model_name()
    warm_up(Client(args.peer_url, args.peer_api_key, timeout=WARM_UP_TIMEOUT_S), name, [as_sent(warm[0])], 1)
    loads = []
    for c, prompts in zip(args.concurrency, levels):
        before = spec_counts(peer)
        load = run_load(peer, [_completion(name, as_sent(p), args.output_tokens) for p in prompts], c)
        loads.append(load)
        say(f"peer c={c}: {load.output_tokens_per_s:.1f} tok/s, TTFT p50 {load.ttft(50) * 1000:.0f} ms, "
            f"TPOT p50 {load.tpot(50) * 1000:.1f} ms, {load.errors} errors{spec_note(before, spec_counts(peer))}")  # fmt: skip
    return loads


def decode_path(client: Client) -> str | None:
    """The server's ``decode_path`` from its ``/health`` (None: a server that does not say)."""
    try:
        status, body = client.get("/health")
        return json.loads(body).get("decode_path") if status == 200 else None
    except (OSError, ValueError, AttributeError):
        return None


def peer_facts(args: argparse.Namespace) -> str:
    """What the peer says of itself (llama-server's ``/props``: its build and slots) and the threads
    ``--peer-threads`` gives: the peer runs on this machine, so its CPU is the header's. A peer of
    ``--peer-serve-args``: the options it adds."""
    if args.peer_serve_args is not None:
        return f"the same server with {args.peer_serve_args or 'no more options'}"
    facts = []
    try:
        status, body = Client(args.peer_url, args.peer_api_key).get("/props")
        props = json.loads(body) if status == 200 else {}
        if isinstance(props, dict):
            facts += [f"build {props['build_info']}"] if props.get("build_info") else []
            facts += [f"{props['total_slots']} slots"] if props.get("total_slots") else []
    except (OSError, ValueError):
        pass
    facts.append(f"{args.peer_threads} thread(s)" if args.peer_threads else "threads not given (--peer-threads)")
    return ", ".join(facts)


def _header(args: argparse.Namespace, device: str, model_path: str, build_s: float | None, path: str | None = None) -> str:
    import torch

    from gyrfalcon.models.loading import resolve_dtype

    from gyrfalcon.kernels.native.cpu import cpu

    dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    where = torch.cuda.get_device_name() if device.startswith("cuda") else f"{cpu().describe()}, {args.num_threads} thread(s)"
    subject = os.path.basename(os.path.normpath(model_path))
    if build_s is not None:
        subject += f" (random weights, built in {build_s:.1f} s)"
    levels = ", ".join(f"{requests_at(args, c, device)} at c={c}" for c in args.concurrency)
    prompts = f"{args.prompt_tokens}-token prompts" if args.workload == "random" else "edit prompts (copy a passage)"
    return (f"{subject} on {device} ({where}), {dtype}; requests {levels}; {prompts} "
            f"(seed {args.prompt_seed}), "
            f"{args.output_tokens} output tokens, temperature 0, ignore_eos; --quantization {args.quantization}. "
            f"ceiling: the eager loop on the same weights" + ("; baseline: the fp32 eager loop" if not device.startswith("cuda") else "")
            + (f"; peer: {args.peer_url} ({peer_facts(args)})" if args.peer_url else "") + (f"; decode path: {path}" if path else "")
            + ("; compiled: static cache + torch.compile" if args.compiled_ceiling else ""))  # fmt: skip


def _model_path(args: argparse.Namespace, device: str, workdir: str) -> tuple[str, float | None]:
    """The model to serve — random weights of ``--random-weights`` built under ``workdir``, else
    ``--model`` (or the default) — and the seconds building took (None: nothing was built)."""
    from gyrfalcon.models.default import resolve_model

    if not args.random_weights:
        return resolve_model(args.model, None), None
    from gyrfalcon.bench.weights import build_timed, folder_name

    tokenizer = args.tokenizer or resolve_model(None, None)
    folder = os.path.join(workdir, folder_name(args.random_weights))
    built, build_s = build_timed(args.random_weights, tokenizer, folder, device, args.dtype, args.seed)
    say(f"random weights of {args.random_weights} built in {build_s:.1f} s")
    return str(built), build_s


def _launch(args: argparse.Namespace, device: str, model_path: str, workdir: str, peer: bool = False):
    """``gyrfalcon serve`` for ``--launch``, its log under ``workdir``; ``peer``: the one of
    ``--peer-serve-args``, whose URL becomes ``--peer-url``."""
    from gyrfalcon.bench.server import launch, serve_argv

    def argv(port: int) -> list[str]:
        extra = f"--quantization {args.quantization} {args.serve_args} {args.peer_serve_args if peer else ''}"
        return serve_argv(port, model_path, device, args.dtype, args.num_threads, max(args.concurrency), extra)

    server = launch(argv, os.path.join(workdir, "peer-serve.log" if peer else "serve.log"))
    say(f"{'peer' if peer else 'server'} at {server.url}: {shlex.join(server.argv[2:])}")
    if peer:
        args.peer_url = server.url
    return server


def _stop(*servers: Any) -> None:
    for server in servers:
        if server is not None:
            server.stop()


def _served_loads(client: Client, name: str, args: argparse.Namespace, levels: list[list]) -> list:
    """One load per ``--concurrency`` level, each on its own prompts (drafts accepted, if it speculates)."""
    loads = []
    for c, prompts in zip(args.concurrency, levels):
        before = spec_counts(client)
        load = run_load(client, [_completion(name, p, args.output_tokens) for p in prompts], c)
        loads.append(load)
        say(f"c={c}: {load.output_tokens_per_s:.1f} tok/s, TTFT p50 {load.ttft(50) * 1000:.0f} ms, "
            f"TPOT p50 {load.tpot(50) * 1000:.1f} ms, {load.errors} errors{spec_note(before, spec_counts(client))}")  # fmt: skip
    return loads


def _n_and_memory(client: Client, name: str, args: argparse.Namespace, prompt, vocab: int):
    """The n-choices comparison (``--n`` > 1) and the memory check (``--mixed``), None where not asked."""
    from gyrfalcon.bench.memory import memory_check

    n_cmp = n_comparison(client, name, prompt, args.n, args.output_tokens) if args.n > 1 else None
    if n_cmp:
        say(f"{n_cmp}")
    memory = None
    if args.mixed:
        memory = memory_check(client, name, args.mixed, vocab, args.seed)
        say(f"memory {memory}")
    return n_cmp, memory


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; print the table (and write JSON with ``--json``)."""
    started = time.perf_counter()
    from gyrfalcon.models.loading import resolve_device

    device = resolve_device(args.device)
    if error := resolve_options(args, device):
        print(f"gyrfalcon bench: {error}", file=sys.stderr)
        return 2
    from gyrfalcon.bench.report import figures, table

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops a launched server
    workdir = tempfile.mkdtemp(prefix="gyrfalcon-bench-")
    server, peer_server, build_s = None, None, None
    try:
        model_path, build_s = _model_path(args, device, workdir)
        url = args.url
        if args.launch:
            server = _launch(args, device, model_path, workdir)
            url = server.url
            if args.peer_serve_args is not None:
                peer_server = _launch(args, device, model_path, workdir, peer=True)
        client = Client(url, args.api_key)
        name = client.model_name()
        path = decode_path(client)
        vocab = _vocab(model_path)
        counts = [requests_at(args, c, device) for c in args.concurrency]
        warm, levels = level_prompts(args.workload, counts, max(args.concurrency), args.prompt_tokens, vocab,
                                     args.prompt_seed, model_path)  # fmt: skip
        warm_up(Client(url, args.api_key, timeout=WARM_UP_TIMEOUT_S), name, warm, max(args.concurrency), server)
        loads = _served_loads(client, name, args, levels)
        peer_loads = run_peer(args, model_path, warm, levels) if args.peer_url else []
        n_cmp, memory = _n_and_memory(client, name, args, warm[0], vocab)
        _stop(server, peer_server)  # free the device (and the CPU) for the ceilings
        ceilings: dict[str, Any] = {"eager": {}, "compiled": {}, "compiled_error": None, "peak_memory": None, "baseline": {}}
        if not args.no_ceiling:
            ceilings = run_ceilings(model_path, args, device, warm)
        header = _header(args, device, model_path, build_s, path)
    except RuntimeError as exc:  # the server failed to start, or a request failed
        print(f"gyrfalcon bench: {exc}", file=sys.stderr)
        return 1
    finally:
        _stop(server, peer_server)
        shutil.rmtree(workdir, ignore_errors=True)
    wall = time.perf_counter() - started
    text = table(loads, ceilings["eager"], ceilings["compiled"], n_cmp, memory, device, ceilings["compiled_error"],
                 ceilings["peak_memory"], ceilings["baseline"], peer_loads, args.peer_serve_args)  # fmt: skip
    print(f"{header}\n\n{text}\n\ntotal wall time {wall:.0f} s")
    if args.plot:
        from gyrfalcon.bench.plot import write_plot

        write_plot(args.plot, args.concurrency, loads, peer_loads, header)
    if args.json:
        data = figures(device, loads, ceilings["eager"], ceilings["compiled"], n_cmp, memory, dtype=args.dtype,
                       compiled_error=ceilings["compiled_error"], peak_memory=ceilings["peak_memory"], build_s=build_s,
                       wall_s=wall, quantization=args.quantization, baseline=ceilings["baseline"], decode_path=path,
                       peer_loads=peer_loads, variant=args.peer_serve_args)  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
    return 0
