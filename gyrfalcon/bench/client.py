"""A fixed-concurrency load generator for any OpenAI-compatible server (stdlib ``http.client`` only).

Requests are ``POST /v1/completions`` with token-id prompts (so every server sees the same prompt
lengths), streamed to measure the time to the first token (TTFT) and the time per output token
(TPOT: from the first token to the last, divided by the tokens after the first). Token counts come
from the final usage chunk (``stream_options.include_usage``), so coalesced chunks count right.
"""

from __future__ import annotations

import http.client
import json
import queue
import random
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Result:
    """One request: timings in seconds, tokens from usage (or counted chunks), error text if it failed."""

    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class LoadReport:
    """Aggregate of one load run."""

    concurrency: int
    wall: float
    results: list[Result] = field(default_factory=list)

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.error is None]

    @property
    def errors(self) -> int:
        return len(self.results) - len(self.ok)

    @property
    def request_throughput(self) -> float:
        return len(self.ok) / self.wall

    @property
    def output_tokens_per_s(self) -> float:
        return sum(r.output_tokens for r in self.ok) / self.wall

    def ttft(self, q: float) -> float:
        return percentile([r.ttft for r in self.ok], q)

    def tpot(self, q: float) -> float:
        return percentile([t for r in self.ok if (t := r.tpot) is not None], q)


def say(text: str) -> None:
    """A line of the bench's progress, on stderr (the report goes to stdout)."""
    print(f"bench: {text}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linearly interpolated; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


class Client:
    """Connection details of one server: ``url`` like ``http://127.0.0.1:8000``, optional API key."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self.https = parsed.scheme == "https"
        self.prefix = parsed.path.rstrip("/")
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def get(self, path: str) -> tuple[int, bytes]:
        conn = self.connect()
        try:
            conn.request("GET", self.prefix + path, headers=self.headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def post_json(self, path: str, body: dict[str, Any], conn: http.client.HTTPConnection | None = None) -> tuple[int, Any]:
        own = conn is None
        conn = conn or self.connect()
        try:
            conn.request("POST", self.prefix + path, body=json.dumps(body), headers=self.headers)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, json.loads(data) if data else None
        finally:
            if own:
                conn.close()

    def model_name(self) -> str:
        status, body = self.get("/v1/models")
        if status != 200:
            raise RuntimeError(f"GET /v1/models answered {status}")
        return json.loads(body)["data"][0]["id"]

    def stream_completion(self, body: dict[str, Any], conn: http.client.HTTPConnection) -> Result:
        """POST a streaming completion and time it (``body`` gets ``stream`` and usage set)."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        result = Result()
        start = time.perf_counter()
        try:
            conn.request("POST", self.prefix + "/v1/completions", body=json.dumps(body), headers=self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
                return result
            chunks = 0
            while True:
                line = resp.readline()
                if not line:
                    break
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    resp.read()  # drain the chunked terminator so the connection can be reused
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])
                    continue
                if event.get("usage"):
                    result.output_tokens = event["usage"].get("completion_tokens", 0)
                if any(c.get("text") for c in event.get("choices", [])):
                    chunks += 1
                    if chunks == 1:
                        result.ttft = time.perf_counter() - start
                    result.latency = time.perf_counter() - start
            result.output_tokens = result.output_tokens or chunks
        except (OSError, http.client.HTTPException, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        return result


#: how a request fails on a kept-alive connection its server has closed (before any response)
STALE_CONNECTION = ("RemoteDisconnected", "ConnectionResetError", "BrokenPipeError")


def run_load(client: Client, bodies: list[dict[str, Any]], concurrency: int) -> LoadReport:
    """Send every body as a streaming completion with ``concurrency`` requests in flight at all times."""
    work: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
    for body in bodies:
        work.put(body)
    for _ in range(concurrency):
        work.put(None)
    results: list[Result] = []
    lock = threading.Lock()

    def worker() -> None:
        conn, used = client.connect(), False
        try:
            while (body := work.get()) is not None:
                result = client.stream_completion(body, conn)
                if used and (result.error or "").startswith(STALE_CONNECTION):
                    # the server closed the kept-alive connection after its last answer (llama-server
                    # does after a stream): the request never reached it; send it on a new one
                    conn.close()
                    conn = client.connect()
                    result = client.stream_completion(body, conn)
                used = True
                if result.error is not None:  # reconnect after a failure
                    conn.close()
                    conn, used = client.connect(), False
                with lock:
                    results.append(result)
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return LoadReport(concurrency, time.perf_counter() - start, results)


#: the counters of a gyrfalcon server that speculates (vLLM's names, the server's prefix)
SPEC = "gyrfalcon:spec_decode_num_"


def spec_counts(client: Client) -> tuple[int, int]:
    """The server's draft tokens so far and those accepted (vLLM's ``spec_decode`` counters; 0, 0
    where it does not speculate or says nothing)."""
    try:
        status, body = client.get("/metrics")
    except (OSError, http.client.HTTPException):
        return 0, 0
    counts = {f"{SPEC}draft_tokens_total": 0.0, f"{SPEC}accepted_tokens_total": 0.0}
    for line in body.decode(errors="replace").splitlines() if status == 200 else []:
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in counts:
            counts[name] += float(line.rsplit(" ", 1)[1])
    return int(counts[f"{SPEC}draft_tokens_total"]), int(counts[f"{SPEC}accepted_tokens_total"])


def spec_note(before: tuple[int, int], after: tuple[int, int]) -> str:
    """What :func:`spec_counts` moved by over a load, for its line ("" where nothing was drafted)."""
    drafted, accepted = after[0] - before[0], after[1] - before[1]
    return f", {accepted} of {drafted} draft tokens accepted ({accepted / drafted:.0%})" if drafted > 0 else ""


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids (from 100 up, clear of special tokens)."""
    rng = random.Random(seed)
    low = min(100, vocab // 4)
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(count)]


def fresh_prompts(counts: list[int], warm: int, length: int, vocab: int, seed: int):
    """Prompts for the warm-up, then each level's own, so that a level measures serving, not the
    prompt cache an earlier one filled (``llama-server`` keeps whole prompts in RAM by default)."""
    every = prompts(warm + sum(counts), length, vocab, seed)
    ends = [warm + sum(counts[: i + 1]) for i in range(len(counts))]
    return every[:warm], [every[end - count : end] for end, count in zip(ends, counts)]
