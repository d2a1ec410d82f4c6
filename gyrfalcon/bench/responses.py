"""What the Responses API costs: ``python -m gyrfalcon.bench.responses [--model M] [--runs 20]``.

- **The store**: this process's RSS before and after 10,000 stored responses (the target: under
  50 MiB more), and a writer killed with SIGKILL right after its last ``put`` returned: every
  response it stored is read back.
- **The first event**: ``gyrfalcon serve`` on the model (default: the embedded one); a streamed
  Responses request's first event against a chat stream's first chunk on the same prompt and
  length, alternating, median of ``--runs`` each (the target: within 1.2x).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from gyrfalcon.api.response_store import ResponseStore

PUT_AND_DIE = """
import os, signal, sys
from gyrfalcon.api.response_store import ResponseStore
store = ResponseStore(sys.argv[1], 100000, 3600.0)
for i in range(int(sys.argv[2])):
    store.put({"id": f"resp_{i}", "output": []}, [], [])
os.kill(os.getpid(), signal.SIGKILL)
"""


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def store_figures(count: int = 10_000) -> dict[str, float]:
    folder = tempfile.mkdtemp(prefix="gyrfalcon-bench-store-")
    store = ResponseStore(os.path.join(folder, "responses.sqlite3"), count, 3600.0)
    text = "word " * 300  # a ~1.5 KB answer
    before = _rss()
    started = time.perf_counter()
    for i in range(count):
        response = {"id": f"resp_{i}", "object": "response", "output": [{"type": "message", "content": [{"text": text}]}]}
        store.put(response, [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                  [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}])  # fmt: skip
    put_s = time.perf_counter() - started
    grown = (_rss() - before) / 2**20
    size = os.path.getsize(store.path) / 2**20
    killed = os.path.join(folder, "killed.sqlite3")
    subprocess.run([sys.executable, "-c", PUT_AND_DIE, killed, "500"], check=False)
    survived = len(ResponseStore(killed, 100000, 3600.0))
    return {"stored": len(store), "rss_growth_mib": grown, "file_mib": size, "put_ms": 1000 * put_s / count,
            "killed_writer_kept": survived}  # fmt: skip


def _first_event_s(port: int, path: str, body: dict) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    started = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    while not response.fp.readline().startswith(b"data:"):
        pass
    elapsed = time.perf_counter() - started
    conn.close()
    return elapsed


def first_event_ratio(model: str | None, runs: int) -> dict[str, float]:
    port = 8000 + os.getpid() % 1000
    argv = [sys.executable, "-m", "gyrfalcon.cli", "serve", "--port", str(port), "--cache-dir", tempfile.mkdtemp()]
    if model:
        argv += ["--model", model]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        prompt = "Write one sentence about falcons."
        chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "stream": True, "temperature": 0}
        responses = {"input": prompt, "max_output_tokens": 8, "stream": True, "temperature": 0, "store": False}
        chat_s, responses_s = [], []
        for _ in range(runs):
            chat_s.append(_first_event_s(port, "/v1/chat/completions", chat))
            responses_s.append(_first_event_s(port, "/v1/responses", responses))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    chat_ms, responses_ms = 1000 * statistics.median(chat_s), 1000 * statistics.median(responses_s)
    return {"chat_first_chunk_ms": chat_ms, "responses_first_event_ms": responses_ms, "ratio": responses_ms / chat_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyrfalcon.bench.responses", description=__doc__)
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the embedded model)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--store-only", action="store_true", help="only the store's figures")
    args = parser.parse_args(argv)
    store = store_figures()
    print(f"store: {store['stored']} responses, RSS +{store['rss_growth_mib']:.1f} MiB (target < 50), file "
          f"{store['file_mib']:.1f} MiB, {store['put_ms']:.2f} ms a put; a writer killed after 500 puts: "
          f"{store['killed_writer_kept']} kept")  # fmt: skip
    if not args.store_only:
        first = first_event_ratio(args.model, args.runs)
        print(f"first event: responses {first['responses_first_event_ms']:.1f} ms, chat {first['chat_first_chunk_ms']:.1f} ms, "
              f"ratio {first['ratio']:.2f} (target <= 1.2)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
