"""`gyrfalcon serve --api-workers 2`: two API workers around one engine process, and their faults."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.live_server import start_server, stop_server

pytestmark = pytest.mark.live


@pytest.fixture
def two_workers(tiny_model_dir, tmp_path):
    server = start_server(["--model", tiny_model_dir, "--max-model-len", "256", "--max-num-seqs", "1", "--num-threads", "1",
                           "--served-model-name", "tiny", "--api-workers", "2"], str(tmp_path / "server.log"))  # fmt: skip
    yield server
    stop_server(server)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _processes(server) -> tuple[int, list[int]]:
    """(engine pid, API worker pids) of a server started by `gyrfalcon serve`."""
    engine, master = None, None
    for pid in _children(server.process.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"gyrfalcon.engine_main" in cmdline:
            engine = pid
        elif b"gunicorn" in cmdline:
            master = pid
    assert engine and master, server.log()
    return engine, _children(master)


def _engine_counts(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("gyrfalcon_requests_") or s.name.startswith("gyrfalcon:num_requests_")}  # fmt: skip


def _complete(url: str, **body) -> requests.Response:
    return requests.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Once upon", **body}, timeout=60)


def test_two_workers_share_one_engine(two_workers):
    engine, workers = _processes(two_workers)
    assert len(workers) == 2
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _complete(two_workers.url, max_tokens=4, n=2, seed=i), range(24)))
    assert [r.status_code for r in answers] == [200] * 24
    assert all(len(r.json()["choices"]) == 2 for r in answers)
    # same seed through either worker: same tokens
    texts = {_complete(two_workers.url, max_tokens=6, seed=5, temperature=1.0).json()["choices"][0]["text"]
             for _ in range(6)}  # fmt: skip
    assert len(texts) == 1
    with open(two_workers.log_path, errors="replace") as f:
        connected = set(re.findall(r"API worker w(\d+)-\w+ connected", f.read()))
    assert connected == {str(pid) for pid in workers}


def test_the_engines_openmp_threads_spin_briefly_unless_the_operator_chose(two_workers):
    """A busy core elsewhere on the machine collapsed the engine while its OpenMP threads spun at
    barriers for libgomp's default (1.9 tok/s at c=1 on 2 cores): the engine process gets a short
    spin (GOMP_SPINCOUNT), and an operator's own OpenMP wait settings are left alone."""
    from gyrfalcon.engine_process.launch import GOMP_SPINCOUNT, engine_env

    engine, _ = _processes(two_workers)
    with open(f"/proc/{engine}/environ", "rb") as f:
        assert f"GOMP_SPINCOUNT={GOMP_SPINCOUNT}".encode() in f.read().split(b"\0")
    assert engine_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert engine_env({"GOMP_SPINCOUNT": "INFINITY"}) == {"GOMP_SPINCOUNT": "INFINITY"}


def test_the_engine_shares_the_workers_session_and_yields_to_nothing_they_parse(two_workers):
    """Under the kernel's autogroup scheduling a session is one CPU group: the engine in a session of
    its own shared 2 cores with an API worker parsing 1 MB bodies as two equal groups, and its other
    requests' median latency went 1.8x. It now shares the launcher's session (a process group of its
    own still keeps a terminal's ^C for the launcher), and the worker's large-body lane runs at the
    lowest priority, so that the engine's threads take a core from it at once."""
    from gyrfalcon.api.context import LARGE_BODY_NICE

    engine, workers = _processes(two_workers)
    launcher = two_workers.process.pid
    assert os.getsid(engine) == os.getsid(launcher) and os.getpgid(engine) == engine != os.getpgid(launcher)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    r = requests.post(two_workers.url + "/v1/completions", timeout=60, json={  # a large body: the lane's
        "model": "tiny", "prompt": "hi", "max_tokens": 1, "user": "u" * (80 << 10),
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    assert r.status_code == 200, r.text
    # of every thread of the workers (the tokenizer's pool included, which a library starts on first
    # use and whose threads would inherit the priority of the thread that started it): only the lane
    nice = []
    for worker in workers:
        for tid in os.listdir(f"/proc/{worker}/task"):
            with open(f"/proc/{worker}/task/{tid}/stat") as f:
                nice.append(int(f.read().rsplit(")", 1)[1].split()[16]))
    assert sorted(set(nice)) == [0, LARGE_BODY_NICE] and nice.count(LARGE_BODY_NICE) == 1, nice


def test_killed_workers_are_replaced_and_their_requests_aborted(two_workers):
    url = two_workers.url
    _, workers = _processes(two_workers)
    before = _engine_counts(url)
    # 64 × 240 steps of work queued behind one running sequence (about 0.2 s each since the CPU's
    # kernels of 2026-12-04, 0.5 s before): far more than the time to notice (3 s of silence), in
    # which about 15 finish (with 32 requests, 17 of 32 once finished before the notice)
    total = 64
    pool = concurrent.futures.ThreadPoolExecutor(total)
    futures = [pool.submit(_complete, url, max_tokens=240, ignore_eos=True) for _ in range(total)]
    # every request in the engine before the kill: one a worker still held (reading, tokenizing)
    # dies with it and never reaches the engine, which then has nothing to abort (a clean-clone CI
    # run on a loaded machine killed the workers with 7 of the 32 still there)
    deadline = time.monotonic() + 30  # well inside the requests' 60 s time-out
    while (_engine_counts(url)["gyrfalcon_requests_submitted_total"] - before["gyrfalcon_requests_submitted_total"] < total
           and time.monotonic() < deadline):  # fmt: skip
        time.sleep(0.05)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    cut = 0
    for future in futures:  # a request its worker held is cut; one that had finished is whole
        try:
            answer = future.result()
        except requests.ConnectionError:
            cut += 1
        else:  # the first ones run alone and take about 0.5 s: on a loaded machine one may finish first
            assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length", answer.text
    assert cut >= total // 2, f"only {cut} of {total} requests were cut by the kill"
    pool.shutdown()
    deadline = time.monotonic() + 30
    counts = {}
    while time.monotonic() < deadline:
        try:
            counts = _engine_counts(url)
        except requests.RequestException:
            counts = {}
        if counts and counts["gyrfalcon:num_requests_running"] + counts["gyrfalcon:num_requests_waiting"] == 0:
            break
        time.sleep(0.2)
    assert counts, two_workers.log()
    aborted = counts["gyrfalcon_requests_aborted_total"] - before["gyrfalcon_requests_aborted_total"]
    finished = counts["gyrfalcon_requests_finished_total"] - before["gyrfalcon_requests_finished_total"]
    assert aborted + finished == total and aborted >= total // 2, counts
    _, replaced = _processes(two_workers)
    assert len(replaced) == 2 and not set(replaced) & set(workers)
    assert _complete(url, max_tokens=2).status_code == 200


def test_a_dead_engine_stops_the_server_for_its_supervisor(two_workers):
    engine, _ = _processes(two_workers)
    os.kill(engine, signal.SIGKILL)
    assert two_workers.process.wait(timeout=15) == 1
    assert "the engine process exited" in two_workers.log()


def test_the_launcher_and_gunicorn_master_never_import_torch():
    check = ("import sys, gyrfalcon.cli, gyrfalcon.engine_process.launch, gyrfalcon.gunicorn_conf; "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
