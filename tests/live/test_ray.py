"""`gyrfalcon serve --ray`: engine replicas on Ray Serve behind one endpoint, started as the README
says; the same answers as one process, aborts, autoscaling, a replica killed under load."""

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

from tests.helpers import api_client, sse_events, served_app
from tests.live_server import start_server, stop_server

pytest.importorskip("ray.serve", reason="the Ray Serve extra: pip install -e '.[ray]'")
pytestmark = [pytest.mark.live, pytest.mark.slow]

ENGINE_REPLICA = "ServeReplica:gyrfalcon:engine"
RAY_ARGS = ["--ray", "--served-model-name", "tiny", "--max-model-len", "256", "--max-num-seqs", "8",
            "--num-threads", "1", "--dtype", "float32", "--replica-cpus", "0.5", "--drain-timeout", "5",
            # autoscaling 1 → 2 by ongoing requests, shortened delays
            "--replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "2", "--upscale-delay-s", "0",
            "--downscale-delay-s", "4", "--enable-rl-endpoints", "--enable-lora", "--max-loras", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def client(tiny_engine, tiny_model_dir):
    """The same model in one process (the in-process app of the API tests)."""
    from gyrfalcon.config import Settings

    settings = Settings(model=str(tiny_model_dir), served_model_name=["tiny"])
    return api_client(served_app(tiny_engine, settings))


@pytest.fixture(scope="module")
def ray_server(tiny_model_dir, tmp_path_factory):
    server = start_server(["--model", tiny_model_dir, *RAY_ARGS], str(tmp_path_factory.mktemp("ray") / "server.log"),
                          timeout=300)  # fmt: skip
    yield server
    # SIGTERM to gyrfalcon alone, as Kubernetes or Docker send it: it shuts Ray Serve, then Ray, down
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=60)
    finally:
        stop_server(server)  # whatever is left of the group
    assert server.process.returncode == 0, server.log()
    assert time.monotonic() - started < 60


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def engine_replicas(server) -> list[int]:
    """The pids of ``server``'s engine replicas (Ray names their processes after the deployment;
    Ray's processes descend from the server's, which started Ray)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read()
        except OSError:
            continue
        if ENGINE_REPLICA.encode() in title and _descends_from(int(entry), server.process.pid):
            found.append(int(entry))
    return sorted(found)


def wait_for(condition, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"not within {timeout} s: {what}")


def _metric(url: str, name: str) -> float:
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


SEEDED = {"model": "tiny", "prompt": "Once upon a time", "n": 3, "seed": 7, "temperature": 1.0, "max_tokens": 12,
          "logprobs": 2, "logprob_token_ids": [3, 9, 40], "return_token_ids": True}  # fmt: skip


def test_seeded_n_choices_logprobs_and_ids_match_one_process(ray_server, client):
    """The seeded n > 1 request, token for token and logprob for logprob, against the in-process app."""
    through_ray = requests.post(ray_server.url + "/v1/completions", json=SEEDED, timeout=60)
    assert through_ray.status_code == 200, through_ray.text
    alone = client.simulate_post("/v1/completions", json=SEEDED)
    assert alone.status_code == 200, alone.text
    ray_choices, alone_choices = through_ray.json()["choices"], alone.json["choices"]
    assert [c["index"] for c in ray_choices] == [0, 1, 2]
    for mine, theirs in zip(ray_choices, alone_choices):
        assert mine["token_ids"] == theirs["token_ids"] and mine["text"] == theirs["text"]
        assert mine["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
        assert mine["logprobs"]["token_logprobs"] == pytest.approx(theirs["logprobs"]["token_logprobs"], abs=1e-4)
    # streamed: every choice, the same tokens
    streamed = requests.post(ray_server.url + "/v1/completions", json={**SEEDED, "stream": True}, timeout=60)
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    ids: dict[int, list[int]] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            ids.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
    assert [ids[i] for i in range(3)] == [c["token_ids"] for c in alone_choices]


def test_a_refusal_is_a_400_naming_its_param_before_any_status(ray_server):
    r = requests.post(ray_server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4,
                                                                "stream": True, "allowed_token_ids": [0],
                                                                "structured_outputs": {"regex": "[0-9]+"}}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text


def test_the_control_routes_answer_once_every_replica_has_applied_them(ray_server, tiny_model_dir):
    """The RL control routes through the Ray ingress: each call goes to every engine replica and
    answers once all have applied it (a pause settled on each, asleep on each, new weights serving on each)."""
    url = ray_server.url
    assert requests.post(url + "/pause", params={"mode": "keep"}, timeout=60).json()["mode"] == "keep"
    assert requests.get(url + "/is_paused", timeout=60).json()["is_paused"] is True
    assert requests.post(url + "/resume", timeout=60).json()["status"] == "resumed"
    asleep = requests.post(url + "/sleep", timeout=60).json()
    assert asleep == {"is_sleeping": True, "level": 1, "asleep": ["kv_cache"]}, asleep
    assert requests.post(url + "/wake_up", timeout=60).json()["is_sleeping"] is False
    answer = requests.post(url + "/update_weights_from_disk", json={"model_path": tiny_model_dir, "weight_version": "v2"},
                           timeout=300)  # fmt: skip
    assert answer.status_code == 200 and answer.json()["weight_version"] == "v2", answer.text
    wait_for(lambda: requests.get(url + "/weight_version", timeout=10).json()["weight_version"] == "v2", 10, "the version")
    assert requests.post(url + "/inference/v1/abort_requests", json={}, timeout=60).json()["status"] == "aborted"
    ok = requests.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200, ok.text
    # a refusal reaches the client as the replicas' core raised it: a 404 naming the field, not a 503
    missing = requests.post(url + "/update_weights_from_disk", json={"model_path": "/not/there"}, timeout=60)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model_path", missing.text


def test_lora_adapters_load_on_every_replica(ray_server, tiny_model_dir, tmp_path):
    from tests.unit.test_lora import write_adapter

    url = ray_server.url
    folder = write_adapter(tiny_model_dir, tmp_path / "adapter", seed=1)
    loaded = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": "first", "lora_path": str(folder)}, timeout=60)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'first' added successfully.", loaded.text
    assert [m["id"] for m in requests.get(url + "/v1/models", timeout=10).json()["data"]] == ["tiny", "first"]
    ask = {"prompt": "hi", "max_tokens": 4, "temperature": 0, "logprobs": 1}
    adapted = requests.post(url + "/v1/completions", json={"model": "first", **ask}, timeout=60)
    base = requests.post(url + "/v1/completions", json={"model": "tiny", **ask}, timeout=60)
    assert adapted.status_code == base.status_code == 200, adapted.text
    assert adapted.json()["choices"][0]["logprobs"] != base.json()["choices"][0]["logprobs"]
    missing = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/not/there"}, timeout=60)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_path", missing.text
    twice = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": "first", "lora_path": str(folder)}, timeout=60)
    assert twice.status_code == 400 and "already been loaded" in twice.json()["error"]["message"], twice.text
    assert requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": "first"}, timeout=60).status_code == 200
    gone = requests.post(url + "/v1/completions", json={"model": "first", **ask}, timeout=60)
    assert gone.status_code == 404, gone.text


def test_a_client_that_goes_away_aborts_its_request_on_the_replica(ray_server):
    aborted = _metric(ray_server.url, "gyrfalcon_requests_aborted_total")
    body = {"model": "tiny", "prompt": "tell", "n": 8, "max_tokens": 240, "ignore_eos": True, "stream": True}
    with requests.post(ray_server.url + "/v1/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    # the connection is closed: the ingress cancels its call, the replica aborts the request
    wait_for(lambda: _metric(ray_server.url, "gyrfalcon_requests_aborted_total") == aborted + 1, 10, "an abort")
    assert _metric(ray_server.url, "gyrfalcon:num_requests_running") == 0


class Load:
    """``workers`` threads sending streamed completions back to back until stopped; each answer is
    kept as (start, end, status, events). Worker ``w`` asks for ``max_tokens + spread * w`` tokens:
    streams of one length start and end together, and a replica whose batch just ended holds no
    stream for the moment its next requests are routed."""

    def __init__(self, url: str, workers: int, max_tokens: int, spread: int = 0) -> None:
        self.url, self.max_tokens, self.spread = url, max_tokens, spread
        self.results: list[tuple[float, float, int, list]] = []
        self._stop = False
        self._pool = concurrent.futures.ThreadPoolExecutor(workers)
        self._futures = [self._pool.submit(self._run, i) for i in range(workers)]

    def _run(self, worker: int) -> None:
        i = 0
        while not self._stop:
            start = time.monotonic()
            body = {"model": "tiny", "prompt": f"worker {worker} request {i}", "max_tokens": self.max_tokens + self.spread * worker,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            r = requests.post(self.url + "/v1/completions", json=body, timeout=120)
            events = sse_events(r.text) if r.status_code == 200 else [r.json()]
            self.results.append((start, time.monotonic(), r.status_code, events))
            i += 1

    def stop(self) -> list[tuple[float, float, int, list]]:
        self._stop = True
        for future in self._futures:
            future.result()
        self._pool.shutdown()
        return self.results


def _last_generate_calls(server, pids: list[int]) -> dict[int, int]:
    """Where in the server's log each of ``pids`` last answered a generate call (-1: never; Ray
    Serve's access log, forwarded to the server's log, names the replica's pid)."""
    with open(server.log_path, errors="replace") as f:
        log = f.read()
    return {pid: max((m.start() for m in re.finditer(rf"{ENGINE_REPLICA} pid={pid}\).*CALL generate OK", log)), default=-1)
            for pid in pids}  # fmt: skip


def _serving(server, pids: list[int]) -> list[int]:
    """Those of ``pids`` that have answered a generate call: a replica that is up and taking requests."""
    last = _last_generate_calls(server, pids)
    return [pid for pid in pids if last[pid] >= 0]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _busiest(pids: list[int], window: float = 1.0) -> int:
    """Of ``pids``, the replica that computed most over the last ``window`` seconds: the one
    surely running streams now. (The replica that last answered a generate call was not: with
    every open stream routed to the other, two clean-clone runs killed one that held none.)"""
    before = {pid: _cpu_seconds(pid) for pid in pids}
    time.sleep(window)
    return max(pids, key=lambda pid: _cpu_seconds(pid) - before[pid])


def _error(events: list) -> dict | None:
    return next((e["error"] for e in events if isinstance(e, dict) and "error" in e), None)


def _serves_what_was_pushed(url: str, version: str, adapter: str) -> None:
    """Every replica serves the weights and the adapter the control routes pushed (the new ones took them over)."""
    time.sleep(1.0)  # the ingress polls the replicas' health (their versions) every half second
    assert requests.get(url + "/weight_version", timeout=10).json()["weight_version"] == version
    assert adapter in [m["id"] for m in requests.get(url + "/v1/models", timeout=10).json()["data"]]


def test_autoscaling_and_a_replica_killed_under_load(ray_server, tiny_model_dir, tmp_path):
    """1 → 2 replicas under load; one killed under load: its clients get an error event at once, new
    requests succeed meanwhile, Ray starts another; back to 1 replica when idle. The replicas Ray
    adds serve the weights and the adapter pushed before they started, as the first one does, even
    the one replacing the only replica (no peer left), and keep a pause made before they started."""
    from tests.unit.test_lora import write_adapter

    assert len(engine_replicas(ray_server)) == 1
    url = ray_server.url
    pushed = requests.post(url + "/update_weights_from_disk", json={"model_path": tiny_model_dir, "weight_version": "v3"},
                           timeout=300)  # fmt: skip
    assert pushed.status_code == 200, pushed.text
    folder = write_adapter(tiny_model_dir, tmp_path / "kept", seed=2)
    loaded = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": "kept", "lora_path": str(folder)}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    wait_for(lambda: requests.get(url + "/weight_version", timeout=10).json()["weight_version"] == "v3", 10, "the version")
    # lengths 90 to 222 (60 to 159 until the CPU kernels of 2026-12-04 made streams so short that one
    # clean-clone run killed a replica with none left open): the streams end at different times, so each replica always runs some
    # (with one length, a kill between two batches of a replica cut nothing, in CI)
    load = Load(ray_server.url, workers=12, max_tokens=90, spread=12)
    try:
        replicas = wait_for(lambda: len(engine_replicas(ray_server)) == 2 and engine_replicas(ray_server), 150, "a second replica")
        # the new replica loads the model, then takes requests: kill one only once both run streams
        wait_for(lambda: _serving(ray_server, replicas) == replicas, 120, "both replicas answering")
        _serves_what_was_pushed(url, "v3", "kept")
        victim = _busiest(replicas)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        # under load, Ray replaces the killed replica
        wait_for(lambda: victim not in engine_replicas(ray_server) and len(engine_replicas(ray_server)) == 2, 90, "a replacement replica")
        wait_for(lambda: len(_serving(ray_server, engine_replicas(ray_server))) == 2, 120, "the replacement answering")
        _serves_what_was_pushed(url, "v3", "kept")
        # Ray may replace the replica within a second; on a loaded machine a 60-token stream takes longer than
        # that, so keep the load on until some requests sent after the kill have been answered
        wait_for(lambda: sum(start > killed_at + 0.5 for start, *_ in list(load.results)) >= 3, 120,
                 "three requests sent after the kill answered")  # fmt: skip
    finally:
        results = load.stop()
    for _, _, status, events in results:  # a stream cut before its first event is a plain 503
        assert (status == 200 and events[-1] == "[DONE]") or (status == 503 and _error(events)), (status, events[-3:])
    cut = [(end, _error(events)) for start, end, _, events in results if _error(events) is not None]
    around = [(round(start - killed_at, 2), round(end - killed_at, 2), status) for start, end, status, _ in results
              if start < killed_at < end]  # fmt: skip
    assert cut, f"streams running on the killed replica end with an error event; open at the kill: {around}"
    for end, error in cut:
        assert error["code"] == 503 and error["type"] == "server_shutting_down", error
        assert end - killed_at < 5.0, f"a cut stream ended {end - killed_at:.1f} s after the kill"
    later = [events for start, _, _, events in results if start > killed_at + 0.5]
    assert later and all(_error(events) is None for events in later), "requests after the kill succeed"
    # idle: back to one replica after the (shortened) downscale delay
    (last,) = wait_for(lambda: len(engine_replicas(ray_server)) == 1 and engine_replicas(ray_server), 120,
                       "scaled back to one replica", interval=1.0)  # fmt: skip
    ok = requests.post(ray_server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200, ok.text
    # the only replica killed while paused: no peer is left, and its replacement still serves what
    # was pushed, paused until the resume
    assert requests.post(url + "/pause", params={"mode": "keep"}, timeout=60).status_code == 200
    os.kill(last, signal.SIGKILL)
    wait_for(lambda: engine_replicas(ray_server) not in ([], [last]), 90, "a replacement for the only replica")
    wait_for(lambda: requests.get(url + "/weight_version", timeout=10).json()["weight_version"] == "v3", 120,
             "the replacement serving the pushed weights")  # fmt: skip
    _serves_what_was_pushed(url, "v3", "kept")
    assert requests.get(url + "/is_paused", timeout=60).json()["is_paused"] is True
    assert requests.post(url + "/resume", timeout=60).json()["status"] == "resumed"
    adapted = requests.post(url + "/v1/completions", json={"model": "kept", "prompt": "hi", "max_tokens": 3}, timeout=60)
    assert adapted.status_code == 200, adapted.text


def test_serve_run_as_the_docs_say(tiny_model_dir, tmp_path):
    """`serve run gyrfalcon.ray:app key=value …` (Ray Serve's own command line, its port 8000)."""
    import socket

    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 8000)) == 0:
            pytest.skip("port 8000 (serve run's) is taken on this machine")
    log = open(tmp_path / "serve-run.log", "wb")
    serve = os.path.join(os.path.dirname(sys.executable), "serve")
    process = subprocess.Popen([serve, "run", "gyrfalcon.ray:app", f"model={tiny_model_dir}", "served_model_name=tiny",
                                "max_model_len=128", "num_threads=1", "replica_cpus=0.5", "drain_timeout=3"],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        def answers() -> bool:
            try:
                return requests.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200
            except requests.RequestException:
                return process.poll() is not None

        wait_for(answers, 240, "serve run's application answers")
        assert process.poll() is None, (tmp_path / "serve-run.log").read_text()[-3000:]
        r = requests.post("http://127.0.0.1:8000/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2})  # fmt: skip
        assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1], r.text
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: serve run shuts Serve down
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
