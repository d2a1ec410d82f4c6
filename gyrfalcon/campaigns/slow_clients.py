"""Slow clients beside a normal one: idle and one-byte connections and streams nobody reads must
cost sockets, not the server's attention.

Targets (issue "A front no client can stall"): with them open, a normal request answers within
2 × its time alone, and ``/health`` within 100 ms.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any

from gyrfalcon.api.worker import raise_open_files_limit
from gyrfalcon.bench.client import Client


@dataclass
class SlowClientReport:
    idle: int
    one_byte: int
    non_reading: int
    alone_s: float
    beside_s: float
    health_alone_ms: float
    health_beside_ms: float

    @property
    def ratio(self) -> float:
        return self.beside_s / self.alone_s

    def met(self) -> bool:
        return self.ratio <= 2.0 and self.health_beside_ms <= 100.0

    def lines(self) -> list[str]:
        return [
            f"held open: {self.idle} idle, {self.one_byte} one-byte, {self.non_reading} non-reading streams",
            f"normal request p50: alone {self.alone_s * 1000:.0f} ms, beside them {self.beside_s * 1000:.0f} ms: "
            f"{self.ratio:.2f} x (target <= 2: {'met' if self.ratio <= 2 else 'missed'})",
            f"/health p50: alone {self.health_alone_ms:.1f} ms, beside them {self.health_beside_ms:.1f} ms "
            f"(target <= 100 ms: {'met' if self.health_beside_ms <= 100 else 'missed'})",
        ]


def _timed(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _connect(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return sock


def _idle_until(client: Client, deadline_s: float = 120.0) -> None:
    """Wait until the engine runs and queues nothing (the non-readers' work is done)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        status, body = client.get("/metrics")
        text = body.decode()
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith(("gyrfalcon_running ", "gyrfalcon_waiting "))}  # fmt: skip
        if values.get("gyrfalcon_running", 1) == 0 and values.get("gyrfalcon_waiting", 1) == 0:
            return
        time.sleep(0.2)
    raise RuntimeError("the engine did not go idle")


def run(url: str, idle: int = 500, one_byte: int = 500, non_reading: int = 100, repeat: int = 5,
        normal: dict[str, Any] | None = None) -> SlowClientReport:  # fmt: skip
    """Measure a normal request and ``/health`` alone, then beside the slow clients (opened here,
    closed at the end). The non-reading streams ask for short answers: what is measured is the
    front, not the engine's queue."""
    raise_open_files_limit()
    client = Client(url, timeout=120)
    model = client.model_name()
    normal = normal or {"model": model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}

    def ask() -> None:
        status, _ = client.post_json("/v1/completions", normal)
        assert status == 200, status

    def health() -> None:
        assert client.get("/health")[0] == 200

    ask()  # warm
    alone = _timed(ask, repeat)
    health_alone = _timed(health, repeat * 4)
    sockets: list[socket.socket] = []
    try:
        stream = json.dumps({"model": model, "prompt": "Tell me a story", "max_tokens": 32, "temperature": 1.0,
                             "ignore_eos": True, "stream": True}).encode()  # fmt: skip
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {client.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(stream)}\r\n\r\n").encode()  # fmt: skip
        for _ in range(non_reading):
            sock = _connect(client.host, client.port)
            sock.sendall(head + stream)  # and never read
            sockets.append(sock)
        _idle_until(client)
        for i in range(idle + one_byte):
            sock = _connect(client.host, client.port)
            if i >= idle:
                sock.sendall(b"P")  # the start of a request line, then nothing
            sockets.append(sock)
        beside = _timed(ask, repeat)
        health_beside = _timed(health, repeat * 4)
    finally:
        for sock in sockets:
            sock.close()
    return SlowClientReport(idle, one_byte, non_reading, alone, beside, health_alone * 1000, health_beside * 1000)
