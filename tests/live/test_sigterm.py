"""SIGTERM under load, as gunicorn gets it from a supervisor: every request gets a status, every
stream a closing event; what was queued gets a 503 with Retry-After; the server exits."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest
import requests

from tests.helpers import sse_events
from tests.live_server import start_server, stop_server

pytestmark = pytest.mark.live

BODY = {"prompt": "Hello", "max_tokens": 100, "temperature": 1.0, "seed": 1, "ignore_eos": True}


def waiting(url: str) -> int:
    text = requests.get(url + "/metrics", timeout=10).text
    return int(float(re.search(r"^gyrfalcon_waiting (\S+)$", text, re.M).group(1)))


def test_sigterm_under_load(tiny_model_dir, tmp_path):
    server = start_server(["--model", tiny_model_dir, "--max-model-len", "128", "--max-num-seqs", "2",
                           "--served-model-name", "tiny", "--num-threads", "1", "--drain-timeout", "1"],
                          str(tmp_path / "server.log"))  # fmt: skip
    results: list = [None] * 16
    try:
        def post(i: int) -> None:
            try:
                r = requests.post(server.url + "/v1/completions", json={**BODY, "stream": i % 2 == 1}, timeout=60)
                results[i] = (r.status_code, r.headers, r.text)
            except requests.RequestException as exc:
                results[i] = ("error", None, repr(exc))

        threads = [threading.Thread(target=post, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while waiting(server.url) < 8:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.02)
        os.kill(server.process.pid, signal.SIGTERM)  # the gunicorn master, as a supervisor sends it
        started = time.monotonic()
        server.process.wait(timeout=30)
        stopped = time.monotonic() - started
        for thread in threads:
            thread.join(30)
    finally:
        stop_server(server)
    print(f"SIGTERM with 16 requests (2 running): exit after {stopped:.1f} s; statuses",
          sorted(str(r[0]) for r in results))
    assert stopped < 1 + 10, server.log()  # the drain's second, then what uvicorn needs to close
    queued = 0
    for status, headers, text in results:
        assert status in (200, 503), (status, text)
        if status == 503:
            queued += 1
            assert headers.get("Retry-After") and json.loads(text)["error"]["type"] == "server_shutting_down"
            continue
        if headers["content-type"].startswith("text/event-stream"):
            events = sse_events(text)  # asserts [DONE] ends it
            last = events[-2]
            assert "error" in last or last["choices"][0]["finish_reason"] == "length", last
        else:
            assert json.loads(text)["choices"][0]["finish_reason"] == "length"
    assert queued >= 8
