"""A soak: thousands of mixed requests — every endpoint, streamed or not, ``n`` 1–3, streams the
client abandons after one event, and invalid bodies of every class — at a fixed concurrency.

Targets (issue "A front no client can stall"): 0 × 5xx; every valid request a 200 and every invalid
one a 4xx; the server healthy and idle at the end.
"""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gyrfalcon.bench.client import Client

#: invalid bodies, by class: (what is sent, its content type)
INVALID: dict[str, tuple[bytes, str]] = {
    "malformed JSON": (b'{"prompt": "x", "max_tokens": ', "application/json"),
    "deep nesting": (b'{"prompt": ' + b"[" * 500 + b"]" * 500 + b"}", "application/json"),
    "wrong type": (b'{"prompt": "x", "max_tokens": "many"}', "application/json"),
    "out of range": (b'{"prompt": "x", "max_tokens": -1}', "application/json"),
    "unknown field": (b'{"prompt": "x", "max_tokens": 2, "frobnicate": true}', "application/json"),
    "huge array": (b'{"prompt": [' + b"1," * 200_000 + b"1]}", "application/json"),
    "not JSON": (b"prompt=x", "application/x-www-form-urlencoded"),
    "NaN": (b'{"prompt": "x", "temperature": NaN}', "application/json"),
    "lone surrogate": (b'{"prompt": "\\ud800"}', "application/json"),
}


@dataclass
class SoakReport:
    requests: int
    seconds: float
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def met(self) -> bool:
        return not self.failures

    def lines(self) -> list[str]:
        fives = sum(v for k, v in self.statuses.items() if k.startswith("5"))
        counted = ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items()))
        return [
            f"{self.requests} requests in {self.seconds:.0f} s: {counted}",
            f"5xx: {fives} (target 0: {'met' if not fives else 'missed'}); unexpected answers: {len(self.failures)}"
            + "".join(f"\n  {f}" for f in self.failures[:10]),
        ]


def _valid(i: int, model: str) -> tuple[str, dict[str, Any], bool]:
    """The ``i``-th valid request: (path, body, abandon after the first event)."""
    n = 1 + i % 3
    sampled = {"temperature": 1.0, "seed": i, "max_tokens": 4 + i % 12}
    kind = i % 7
    if kind == 0:
        return "/v1/completions", {"model": model, "prompt": f"Soak {i}", "n": n, **sampled}, False
    if kind == 1:
        return "/v1/completions", {"model": model, "prompt": f"Soak {i}", "n": n, "stream": True, **sampled}, False
    if kind == 2:
        messages = [{"role": "user", "content": f"Hello {i}"}]
        return "/v1/chat/completions", {"model": model, "messages": messages, "n": n, **sampled}, False
    if kind == 3:
        messages = [{"role": "user", "content": f"Hi {i}"}]
        return "/v1/chat/completions", {"model": model, "messages": messages, "stream": True, **sampled}, False
    if kind == 4:
        params = {"max_tokens": 4, "temperature": 0, "logprobs": 2}
        return "/inference/v1/generate", {"model": model, "token_ids": [5, 6, 7, i % 50 + 1], "sampling_params": params}, False
    if kind == 5:  # a stream the client abandons after its first event
        return "/v1/completions", {"model": model, "prompt": f"Leave {i}", "stream": True, "n": n,
                                   **{**sampled, "max_tokens": 40}, "ignore_eos": True}, True  # fmt: skip
    return "/tokenize", {"model": model, "prompt": f"Tokenize {i}"}, False


def _send(client: Client, path: str, data: bytes, content_type: str, abandon: bool) -> int:
    conn = client.connect()
    try:
        conn.request("POST", path, body=data, headers={**client.headers, "Content-Type": content_type})
        resp = conn.getresponse()
        if abandon and resp.status == 200:
            resp.fp.readline()  # one line of the first event, then hang up
            return resp.status
        body = resp.read()
        if resp.status == 200 and (resp.getheader("Content-Type") or "").startswith("text/event-stream"):
            if not body.rstrip().endswith(b"data: [DONE]") or b'"error"' in body:
                return 590  # a broken stream: counted as a failure of the server
        return resp.status
    except (OSError, http.client.HTTPException):
        return 599
    finally:
        conn.close()


def run(url: str, requests: int = 2000, concurrency: int = 8, invalid_every: int = 5) -> SoakReport:
    """Send ``requests`` (one in ``invalid_every`` invalid, cycling through :data:`INVALID`)."""
    client = Client(url, timeout=300)
    model = client.model_name()
    work: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(requests):
        work.put(i)
    report = SoakReport(requests, 0.0)
    lock = threading.Lock()
    invalid = list(INVALID.items())

    def worker() -> None:
        while True:
            try:
                i = work.get_nowait()
            except queue.Empty:
                return
            if i % invalid_every == invalid_every - 1:
                name, (data, content_type) = invalid[(i // invalid_every) % len(invalid)]
                status = _send(client, "/v1/completions", data, content_type, False)
                ok = 400 <= status < 500
                label = f"invalid ({name})"
            else:
                path, body, abandon = _valid(i, model)
                status = _send(client, path, json.dumps(body).encode(), "application/json", abandon)
                ok = status == 200
                label = path + (" abandoned" if abandon else "")
            with lock:
                report.statuses[str(status)] += 1
                if not ok:
                    report.failures.append(f"{label}: {status}")

    started = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report.seconds = time.monotonic() - started
    if client.get("/health")[0] != 200:
        report.failures.append("/health is not 200 after the soak")
    return report
