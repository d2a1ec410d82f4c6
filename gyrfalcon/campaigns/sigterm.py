"""SIGTERM under load: every request gets a status, every stream a closing event, and what was
queued gets a 503 with ``Retry-After``.

Target (issue "A front no client can stall"): with queued work, 0 requests without a status or
without a closing event; every queued one a 503.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gyrfalcon.bench.client import Client
from gyrfalcon.bench.server import Server


@dataclass
class SigtermReport:
    requests: int
    waiting_at_sigterm: int
    exit_s: float
    #: outcome -> count: "finished", "cut (error event)", "503", and the failures
    outcomes: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def met(self) -> bool:
        return not self.failures and self.outcomes["503"] >= 1

    def lines(self) -> list[str]:
        counted = ", ".join(f"{k}: {v}" for k, v in sorted(self.outcomes.items()))
        return [
            f"SIGTERM with {self.requests} requests in flight ({self.waiting_at_sigterm} queued): {counted}",
            f"the server exited {self.exit_s:.1f} s after SIGTERM",
            f"requests without a status or a closing event: {len(self.failures)} (target 0: "
            f"{'met' if not self.failures else 'missed'})" + "".join(f"\n  {f}" for f in self.failures[:10]),
        ]


def _in_engine(client: Client) -> tuple[int, int, int]:
    """(requests submitted since the engine started, running, waiting), from the engine's stats on
    /metrics (which may be up to a second old)."""
    _, body = client.get("/metrics")
    names = ("gyrfalcon_requests_submitted_total ", "gyrfalcon_running ", "gyrfalcon_waiting ")
    values = {line.split()[0]: int(float(line.split()[1])) for line in body.decode().splitlines() if line.startswith(names)}
    return tuple(values.get(name.strip(), 0) for name in names)  # type: ignore[return-value]


def _classify(status: Any, content_type: str, body: bytes, retry_after: str | None) -> str:
    """The outcome of one request, or a failure beginning with "FAIL"."""
    if status == 503:
        error = json.loads(body).get("error", {})
        if not retry_after or error.get("type") != "server_shutting_down":
            return f"FAIL 503 without Retry-After or the shutting-down type: {body[:200]!r}"
        return "503"
    if status != 200:
        return f"FAIL status {status}: {body[:200]!r}"
    if not content_type.startswith("text/event-stream"):
        choices = json.loads(body)["choices"]
        return "finished" if all(c["finish_reason"] for c in choices) else "FAIL an unfinished answer"
    events = [block[6:] for block in body.decode().split("\n\n") if block.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "FAIL a stream without [DONE]"
    last = json.loads(events[-2]) if len(events) > 1 else {}
    if "error" in last:
        return "cut (error event)"
    if any(c.get("finish_reason") for c in last.get("choices", [])) or "usage" in last:
        return "finished"
    return "FAIL a stream whose last event neither finishes nor errs"


def run(server: Server, requests: int = 48, body: dict[str, Any] | None = None) -> SigtermReport:
    """Send ``requests`` (every other one streamed), SIGTERM the server's master once every one is
    in the engine (running or queued: none still in a socket's backlog, which closing the listener
    resets), and classify every answer."""
    client = Client(server.url, timeout=120)
    body = body or {"prompt": "Tell me a story", "max_tokens": 100, "temperature": 1.0, "ignore_eos": True}
    results: list[Any] = [None] * requests

    def send(i: int) -> None:
        conn = client.connect()
        payload = {**body, "seed": i, "stream": i % 2 == 1}
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(payload), headers=client.headers)
            resp = conn.getresponse()
            results[i] = (resp.status, resp.getheader("Content-Type") or "", resp.read(), resp.getheader("Retry-After"))
        except OSError as exc:
            results[i] = (f"no status ({exc!r})", "", b"", None)
        finally:
            conn.close()

    submitted = _in_engine(client)[0]
    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(requests)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    # every one has reached the engine (a counter: /metrics may be a second old, and the first
    # requests may have ended meanwhile)
    while (counts := _in_engine(client))[0] - submitted < requests:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {counts[0] - submitted} requests reached the engine; the end of the log:\n"
                               f"{server.log_tail()}")  # fmt: skip
        time.sleep(0.05)
    waiting = counts[2]
    os.kill(server.proc.pid, signal.SIGTERM)  # the gunicorn master, as a supervisor sends it
    started = time.monotonic()
    server.proc.wait(timeout=120)
    exit_s = time.monotonic() - started
    for thread in threads:
        thread.join(30)
    report = SigtermReport(requests, waiting, exit_s)
    for result in results:
        outcome = "FAIL no answer at all" if result is None else _classify(*result)
        if outcome.startswith("FAIL"):
            report.failures.append(outcome)
            outcome = "failed"
        report.outcomes[outcome] += 1
    return report
