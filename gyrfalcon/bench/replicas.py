"""What Ray Serve costs and what prefix routing buys: ``python -m gyrfalcon.bench.replicas [--model M]``.

Measured in one run, on the same model (default: a tiny random model with a 2,048-token context,
built here), with servers started one after the other:

1. **Overhead.** A direct server (``gyrfalcon serve``: one engine process) against the same engine
   as one Ray Serve replica (``--ray``): the median time of a one-token completion (the per-request
   overhead) and of a streamed ``--stream-tokens`` completion; the per-chunk overhead is the
   streamed difference less the per-request one, per streamed token. Beside them, Ray Serve's own
   floor for the same shape without gyrfalcon (:mod:`gyrfalcon.bench.ray_floor`).
2. **Prefix routing.** Two replicas with ``--routing prefix`` and with ``--routing pow2``, the same
   multi-turn chat workload (``--conversations`` conversations of ``--turns`` turns, each turn
   sending the whole conversation so far, conversations interleaved): the engines' prefix-cache
   hit rate (hit blocks / queried blocks, from /metrics).

3. **vllm-router** (with ``--vllm-router PATH``, the binary of ``pip install vllm-router``): two
   plain servers behind it — its per-request overhead over a direct server, and the same workload's
   hit rate with its ``cache_aware`` policy against ``random``.

Targets (issue "Beyond one machine"): Ray's per-request overhead at most 10 ms at the median, at
most 1 ms per streamed chunk.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
import urllib.request

from gyrfalcon.bench.server import launch

COMMON = ["--served-model-name", "m", "--max-num-seqs", "8", "--num-threads", "1", "--drain-timeout", "5"]
RAY = ["--ray", "--replica-cpus", "0.5"]


def _post(url: str, body: dict) -> bytes:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return response.read()


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def overhead(url: str, repeats: int, stream_tokens: int) -> tuple[float, float]:
    """(median ms of a one-token completion, median ms of a streamed ``stream_tokens`` one)."""
    one = {"model": "m", "prompt": "Hello", "max_tokens": 1}
    streamed = {"model": "m", "prompt": "Hello", "max_tokens": stream_tokens, "ignore_eos": True, "stream": True}
    return (_median_ms(lambda: _post(url + "/v1/completions", one), repeats),
            _median_ms(lambda: _post(url + "/v1/completions", streamed), max(5, repeats // 4)))  # fmt: skip


def _prefix_counts(url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("gyrfalcon_prefix_cache_queries_total", "gyrfalcon_prefix_cache_hits_total"):
            if line.startswith(name + " "):
                values[name] = float(line.split()[1])
    return values["gyrfalcon_prefix_cache_queries_total"], values["gyrfalcon_prefix_cache_hits_total"]


def multi_turn(url: str, conversations: int, turns: int, concurrency: int) -> float:
    """Prefix-cache hit rate of the workload (see the module docstring)."""
    queries0, hits0 = _prefix_counts(url)
    _run_conversations(url, conversations, turns, concurrency)
    queries, hits = _prefix_counts(url)
    return (hits - hits0) / max(queries - queries0, 1)


def _run_conversations(url: str, conversations: int, turns: int, concurrency: int, tag: str = "") -> None:
    """``tag`` starts every system prompt: runs with different tags share no cached prefix."""
    histories = [[{"role": "system", "content": f"{tag}You are assistant number {c}. Answer briefly and kindly."}]
                 for c in range(conversations)]  # fmt: skip

    def turn(c: int, t: int) -> None:
        history = histories[c]
        history.append({"role": "user", "content": f"Conversation {c}, question {t}: what comes next in the story?"})
        body = {"model": "m", "messages": history, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        answer = json.loads(_post(url + "/v1/chat/completions", body))["choices"][0]["message"]["content"]
        history.append({"role": "assistant", "content": answer})

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for t in range(turns):  # every conversation's turn t, then turn t + 1 (interleaved)
            list(pool.map(lambda c: turn(c, t), range(conversations)))


def _two_prefix_counts(urls: list[str]) -> tuple[float, float]:
    counts = [_prefix_counts(url) for url in urls]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


class _Router:
    """vllm-router on a free port in front of ``workers``."""

    def __init__(self, binary: str, policy: str, workers: list[str], log: str) -> None:
        import socket
        import subprocess

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock2 = socket.socket()
            sock2.bind(("127.0.0.1", 0))
            metrics_port = sock2.getsockname()[1]
            sock2.close()
        self.url = f"http://127.0.0.1:{port}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                                          "--prometheus-port", str(metrics_port), "--worker-urls", *workers],
                                         stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                _post(self.url + "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1})
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm-router did not answer within 60 s (log: {log})")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def vllm_router(binary: str, model: str, args: argparse.Namespace, log_dir: str) -> None:
    """Section 3 of the module docstring."""
    servers = [_serve(model, ["--engine-process"], log_dir, f"plain-{i}") for i in range(2)]
    try:
        urls = [s.url for s in servers]
        direct_one, _ = overhead(urls[0], args.repeats, args.stream_tokens)
        rates = {}
        for policy in ("cache_aware", "random"):
            router = _Router(binary, policy, urls, f"{log_dir}/vllm-router-{policy}.log")
            try:
                if policy == "cache_aware":
                    routed_one, _ = overhead(router.url, args.repeats, args.stream_tokens)
                before = _two_prefix_counts(urls)
                # the same servers for both policies: a tag per policy keeps the first run's cache out
                _run_conversations(router.url, args.conversations, args.turns, args.concurrency, tag=f"[{policy}] ")
                after = _two_prefix_counts(urls)
                rates[policy] = (after[1] - before[1]) / max(after[0] - before[0], 1)
            finally:
                router.stop()
    finally:
        for server in servers:
            server.stop()
    print(f"vllm-router in front of 2 plain servers: one-token completion {routed_one:.1f} ms against {direct_one:.1f} ms "
          f"direct (+{routed_one - direct_one:.1f} ms); multi-turn hit rate {rates['cache_aware']:.3f} with cache_aware, "
          f"{rates['random']:.3f} with random")  # fmt: skip


def _serve(model: str, extra: list[str], log_dir: str, name: str):
    log = f"{log_dir}/{name}.log"
    return launch(lambda port: [sys.executable, "-m", "gyrfalcon.cli", "serve", "--port", str(port), "--model", model,
                                *COMMON, *extra], log, timeout_s=600)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gyrfalcon.bench.replicas", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="a Hugging Face folder (default: a tiny random model built here)")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--vllm-router", default=None, help="the vllm-router binary: also measure it (section 3)")
    p.add_argument("--only", choices=("overhead", "routing", "vllm-router"), default=None, help="one section only")
    args = p.parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="gyrfalcon-bench-replicas-")
    model = args.model
    if model is None:
        from gyrfalcon.models.tiny import build_tiny_model

        model = str(build_tiny_model(f"{log_dir}/tiny", positions=2048))
    print(f"logs: {log_dir}", flush=True)

    if args.only in (None, "overhead"):
        ray_overhead(model, args, log_dir)
    if args.only in (None, "routing"):
        ray_routing(model, args, log_dir)
    if args.vllm_router and args.only in (None, "vllm-router"):
        vllm_router(args.vllm_router, model, args, log_dir)
    return 0


def ray_overhead(model: str, args: argparse.Namespace, log_dir: str) -> None:
    """Section 1 of the module docstring."""
    results = {}
    for name, extra in (("direct", ["--engine-process"]), ("ray", [*RAY, "--replicas", "1"])):
        server = _serve(model, extra, log_dir, name)
        try:
            results[name] = overhead(server.url, args.repeats, args.stream_tokens)
        finally:
            server.stop()
    floor = launch(lambda port: [sys.executable, "-m", "gyrfalcon.bench.ray_floor", str(port)], f"{log_dir}/floor.log",
                   timeout_s=600)  # fmt: skip
    try:
        floor_one, floor_stream = overhead(floor.url, args.repeats, args.stream_tokens)
    finally:
        floor.stop()
    (direct_one, direct_stream), (ray_one, ray_stream) = results["direct"], results["ray"]
    per_request = ray_one - direct_one
    per_chunk = ((ray_stream - direct_stream) - per_request) / args.stream_tokens
    print(f"one-token completion, median: direct {direct_one:.1f} ms, Ray {ray_one:.1f} ms -> "
          f"Ray adds {per_request:.1f} ms per request (target <= 10)")  # fmt: skip
    print(f"{args.stream_tokens}-token stream, median: direct {direct_stream:.1f} ms, Ray {ray_stream:.1f} ms -> "
          f"Ray adds {per_chunk:.2f} ms per streamed chunk (target <= 1)")  # fmt: skip
    print(f"Ray Serve's floor for this shape (gyrfalcon.bench.ray_floor: proxy -> bare ASGI ingress -> handle, no "
          f"model): {floor_one:.1f} ms per request, {(floor_stream - floor_one) / args.stream_tokens:.2f} ms per "
          f"streamed item")  # fmt: skip


def ray_routing(model: str, args: argparse.Namespace, log_dir: str) -> None:
    """Section 2 of the module docstring."""
    rates = {}
    for routing in ("prefix", "pow2"):
        server = _serve(model, [*RAY, "--replicas", "2", "--routing", routing], log_dir, f"ray-{routing}")
        try:
            rates[routing] = multi_turn(server.url, args.conversations, args.turns, args.concurrency)
        finally:
            server.stop()
    print(f"multi-turn chat on 2 replicas ({args.conversations} conversations x {args.turns} turns): prefix-cache hit "
          f"rate {rates['prefix']:.3f} with prefix routing, {rates['pow2']:.3f} with pow2 "
          f"(x{rates['prefix'] / max(rates['pow2'], 1e-9):.2f})")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
