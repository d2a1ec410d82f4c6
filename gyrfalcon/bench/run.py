"""``gyrfalcon bench``: load runs against a server, the bare-loop ceiling, n = 8 and memory checks.

Workload (defaults follow the project's targets): 32-token prompts, temperature 0, ``ignore_eos``,
128 output tokens, 64 requests at concurrency 1, 4 and 16; then one n = 8 request against 8
sequential n = 1 requests; then the worker's RSS before and after 1,000 mixed requests (after a
warm-up); finally, with the server idle, the bare torch loop at the same batch sizes in this process.
``--launch`` starts ``gyrfalcon serve`` with default settings on a free port and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from gyrfalcon.bench.client import Client, LoadReport, run_load


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    p.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:8000 (or use --launch)")
    p.add_argument("--launch", action="store_true", help="start `gyrfalcon serve` (default settings) for the run")
    p.add_argument("--model", default=None, help="model folder or .gguf for --launch and the ceiling (default: embedded)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--n", type=int, default=8, help="choices for the n vs sequential comparison (0: skip)")
    p.add_argument("--mixed", type=int, default=1000, help="mixed requests for the memory check (0: skip)")
    p.add_argument("--no-ceiling", action="store_true", help="skip the bare torch loop")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the figures to this file")


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low = min(100, vocab // 4)
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(count)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: str | None, threads: int, dtype: str) -> tuple[subprocess.Popen, str]:
    """Start `gyrfalcon serve` with default settings; return the process and its URL once healthy."""
    port = _free_port()
    argv = [sys.executable, "-m", "gyrfalcon.cli", "serve", "--port", str(port), "--num-threads", str(threads),
            "--dtype", dtype]  # fmt: skip
    if model:
        argv += ["--model", model]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    client = Client(url, timeout=5)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if client.get("/health")[0] == 200:
                return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the server did not become healthy in 300 s")


def worker_rss(client: Client) -> tuple[int | None, int | None]:
    """(pid, VmRSS in bytes) of the engine's worker, from the ``gyrfalcon_pid`` gauge and /proc."""
    status, body = client.get("/metrics")
    if status != 200:
        return None, None
    pid = next((int(float(line.split()[1])) for line in body.decode().splitlines() if line.startswith("gyrfalcon_pid ")), None)
    if pid is None:
        return None, None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return pid, int(line.split()[1]) * 1024
    except OSError:
        pass
    return pid, None


def idle_rss(client: Client, timeout_s: float = 10.0) -> tuple[int | None, int | None]:
    """:func:`worker_rss` once the idle server has settled (two equal readings 0.5 s apart).

    Read right after the last response, RSS still holds the last batch's buffers, which the
    engine returns to the OS when its batch empties; a leak would stay in the settled reading.
    """
    pid, last = worker_rss(client)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        pid, rss = worker_rss(client)
        if rss == last:
            break
        last = rss
    return pid, last


def _completion(model: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
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


def mixed_bodies(model: str, count: int, vocab: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """``count`` varied requests: endpoints, prompt lengths, n, streaming, sampling and stop rules."""
    rng = random.Random(seed)
    bodies = []
    for i in range(count):
        prompt = [rng.randrange(100, vocab) for _ in range(rng.choice([4, 16, 32, 64, 200]))]
        body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(1, 12), "stream": rng.random() < 0.5}
        kind = rng.random()
        if kind < 0.25:
            body.update(temperature=0.0)
        else:
            body.update(temperature=rng.choice([0.7, 1.0]), seed=i, n=rng.choice([1, 1, 2, 4]),
                        top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([-1, 40]))  # fmt: skip
        if rng.random() < 0.2:
            body.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
        if rng.random() < 0.1:
            body.update(stop=["\n"])
        if rng.random() < 0.3:
            messages = [{"role": "user", "content": f"Say something about the number {i}."}]
            bodies.append(("/v1/chat/completions", {**body, "messages": messages}))
        else:
            bodies.append(("/v1/completions", {**body, "prompt": prompt}))
    return bodies


def run_mixed(client: Client, bodies: list[tuple[str, dict[str, Any]]], concurrency: int) -> int:
    """Send the mixed requests (non-streaming bodies via JSON, streaming ones read to the end); errors."""
    import queue
    import threading

    work: queue.SimpleQueue = queue.SimpleQueue()
    for item in bodies:
        work.put(item)
    errors = [0]
    lock = threading.Lock()

    def failed() -> None:
        with lock:
            errors[0] += 1

    def worker() -> None:
        while True:
            try:
                path, body = work.get_nowait()
            except queue.Empty:
                return
            conn = client.connect()
            try:
                conn.request("POST", client.prefix + path, body=json.dumps(body), headers=client.headers)
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    failed()
            except OSError:
                failed()
            finally:
                conn.close()

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors[0]


def _fmt(x: float, digits: int = 1) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def table(loads: list[LoadReport], ceilings: dict[int, Any], n_cmp: dict[str, float] | None,
          memory: dict[str, Any] | None) -> str:  # fmt: skip
    """The markdown table of a run, with the target ratios."""
    lines = [
        "| concurrency | req/s | output tok/s | ceiling tok/s | ratio | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ceiling step (ms) | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for load in loads:
        ceiling = ceilings.get(load.concurrency)
        ceil_tps = ceiling.output_tokens_per_s if ceiling else float("nan")
        ceil_step = ceiling.time_per_step * 1000 if ceiling else float("nan")
        lines.append(
            f"| {load.concurrency} | {_fmt(load.request_throughput, 2)} | {_fmt(load.output_tokens_per_s)} | "
            f"{_fmt(ceil_tps)} | {_fmt(load.output_tokens_per_s / ceil_tps, 2)} | "
            f"{_fmt(load.ttft(50) * 1000, 0)} / {_fmt(load.ttft(99) * 1000, 0)} | "
            f"{_fmt(load.tpot(50) * 1000)} / {_fmt(load.tpot(99) * 1000)} | {_fmt(ceil_step)} | {load.errors} |"
        )
    out = ["\n".join(lines), ""]
    targets = []
    by_c = {load.concurrency: load for load in loads}
    if 16 in by_c and 16 in ceilings:
        targets.append(f"- c=16 output tok/s / ceiling: {by_c[16].output_tokens_per_s / ceilings[16].output_tokens_per_s:.2f} (target ≥ 0.8)")
    if 1 in by_c and 1 in ceilings:
        targets.append(f"- c=1 TPOT p50 / bare step at batch 1: {by_c[1].tpot(50) / ceilings[1].time_per_step:.2f} (target ≤ 1.15)")
    if n_cmp:
        targets.append(f"- n={n_cmp['n']} request: {n_cmp['n_request_s']:.1f} s vs {n_cmp['n']} sequential n=1: "
                       f"{n_cmp['sequential_s']:.1f} s, ratio {n_cmp['ratio']:.2f} (target ≤ 0.4)")  # fmt: skip
    if memory and memory.get("rss_before"):
        targets.append(f"- worker RSS before / after {memory['requests']} mixed requests: {memory['rss_before'] / 2**20:.0f} MiB / "
                       f"{memory['rss_after'] / 2**20:.0f} MiB, growth {memory['growth'] * 100:.1f} % (target < 5 %), "
                       f"{memory['errors']} errors")  # fmt: skip
    out.extend(targets)
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; print the table (and write JSON with ``--json``)."""
    from gyrfalcon.models.default import resolve_model

    if not args.url and not args.launch:
        print("gyrfalcon bench: give --url or --launch", file=sys.stderr)
        return 2
    model_path = resolve_model(args.model, None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops a launched server
    proc = None
    url = args.url
    if args.launch:
        proc, url = launch(model_path, args.num_threads, args.dtype)
        print(f"bench: server at {url}", file=sys.stderr, flush=True)
    try:
        client = Client(url, args.api_key)
        name = client.model_name()
        from transformers import AutoConfig

        vocab = int(AutoConfig.from_pretrained(model_path, local_files_only=True).vocab_size)
        prompts = _prompts(max(args.requests, max(args.concurrency)), args.prompt_tokens, vocab, args.seed)
        run_load(client, [_completion(name, prompts[0], 8)] * 2, 1)  # warm-up
        loads = []
        for c in args.concurrency:
            bodies = [_completion(name, prompts[i % len(prompts)], args.output_tokens) for i in range(args.requests)]
            load = run_load(client, bodies, c)
            loads.append(load)
            print(f"bench: c={c}: {load.output_tokens_per_s:.1f} tok/s, TTFT p50 {load.ttft(50) * 1000:.0f} ms, "
                  f"TPOT p50 {load.tpot(50) * 1000:.1f} ms, {load.errors} errors", file=sys.stderr, flush=True)  # fmt: skip
        n_cmp = n_comparison(client, name, prompts[0], args.n, args.output_tokens) if args.n > 1 else None
        if n_cmp:
            print(f"bench: {n_cmp}", file=sys.stderr, flush=True)
        memory = None
        if args.mixed:
            run_mixed(client, mixed_bodies(name, 50, vocab, args.seed + 1), 8)  # warm-up
            pid, before = idle_rss(client)
            errors = run_mixed(client, mixed_bodies(name, args.mixed, vocab, args.seed + 2), 8)
            _, after = idle_rss(client)
            memory = {"pid": pid, "requests": args.mixed, "rss_before": before, "rss_after": after, "errors": errors,
                      "growth": (after - before) / before if before and after else float("nan")}  # fmt: skip
            print(f"bench: memory {memory}", file=sys.stderr, flush=True)
        ceilings = {}
        if not args.no_ceiling:
            from gyrfalcon.bench.ceiling import bare_loop, load as load_model

            model = load_model(model_path, args.dtype, args.num_threads)
            bare_loop(model, prompts[:2], 4)  # warm-up
            for c in args.concurrency:
                ceilings[c] = bare_loop(model, prompts[:c], args.output_tokens)
            del model
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    text = table(loads, ceilings, n_cmp, memory)
    header = (f"{args.requests} requests per level, {args.prompt_tokens}-token prompts, {args.output_tokens} output tokens, "
              f"temperature 0, ignore_eos, {args.dtype}, {args.num_threads} thread(s), {os.cpu_count()} CPUs")  # fmt: skip
    print(header + "\n\n" + text)
    if args.json:
        figures = {
            "loads": [{"concurrency": x.concurrency, "req_per_s": x.request_throughput, "tok_per_s": x.output_tokens_per_s,
                       "ttft_p50": x.ttft(50), "ttft_p99": x.ttft(99), "tpot_p50": x.tpot(50), "tpot_p99": x.tpot(99),
                       "errors": x.errors} for x in loads],  # fmt: skip
            "ceilings": {c: {"tok_per_s": r.output_tokens_per_s, "step_s": r.time_per_step, "prefill_s": r.prefill_s}
                         for c, r in ceilings.items()},  # fmt: skip
            "n": n_cmp,
            "memory": memory,
        }
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0
