"""The memory check of ``gyrfalcon bench``: the engine worker's RSS before and after many mixed requests.

The worker's pid is the ``gyrfalcon_pid`` gauge of ``/metrics``; its RSS is read from
``/proc/<pid>/status``, so the check needs the server on this machine.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from gyrfalcon.bench.client import Client


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


def memory_check(client: Client, model: str, requests: int, vocab: int, seed: int) -> dict[str, Any]:
    """Worker RSS, settled, before and after ``requests`` mixed requests (8 in flight), after 50 to warm up."""
    run_mixed(client, mixed_bodies(model, 50, vocab, seed + 1), 8)
    pid, before = idle_rss(client)
    errors = run_mixed(client, mixed_bodies(model, requests, vocab, seed + 2), 8)
    _, after = idle_rss(client)
    growth = (after - before) / before if before and after else float("nan")
    return {"pid": pid, "requests": requests, "rss_before": before, "rss_after": after, "errors": errors, "growth": growth}
