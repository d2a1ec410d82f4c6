"""SIGTERM's drain: queued requests get a 503 with Retry-After at once, new ones too, running ones
finish within the drain's time or end with a 503 error event; health turns 503."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from gyrfalcon.config import Settings
from tests.helpers import ServedInThread, sse_events, served_app

LONG = {"prompt": "Hello", "max_tokens": 120, "temperature": 1.0, "seed": 3, "ignore_eos": True}


def run_in_threads(url, bodies):
    results: list = [None] * len(bodies)

    def post(i, body):
        results[i] = requests.post(url + "/v1/completions", json=body, timeout=60)

    threads = [threading.Thread(target=post, args=(i, b)) for i, b in enumerate(bodies)]
    for thread in threads:
        thread.start()
    return results, threads


def wait_running(engine, running, waiting):
    deadline = time.monotonic() + 20
    while not (engine.stats()["running"] >= running and engine.stats()["waiting"] >= waiting):
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.005)


@pytest.mark.parametrize("slow_engine", [0.02], indirect=True)
def test_drain_serves_the_running_and_refuses_the_rest(slow_engine, tiny_model_dir):
    settings = Settings(model=tiny_model_dir, served_model_name=["tiny"], drain_timeout=30)
    app = served_app(slow_engine, settings)
    # the tiny engine runs 8 sequences: two requests of n=4 fill it, two more wait in the queue
    bodies = [{**LONG, "n": 4}, {**LONG, "n": 4, "stream": True}, {**LONG, "n": 4}, {**LONG, "n": 4, "stream": True}]
    with ServedInThread(app) as url:
        results, threads = run_in_threads(url, bodies[:2])
        wait_running(slow_engine, 2, 0)
        more, more_threads = run_in_threads(url, bodies[2:])
        wait_running(slow_engine, 2, 2)
        app.drain()
        for thread in threads + more_threads:
            thread.join(60)
        health = requests.get(url + "/health", timeout=10)
        late = requests.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
    assert health.status_code == 503
    assert late.status_code == 503 and late.headers.get("retry-after")
    plain, stream = results
    assert plain.status_code == 200 and {c["finish_reason"] for c in plain.json()["choices"]} == {"length"}
    events = sse_events(stream.text)
    assert stream.status_code == 200 and events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    for queued in more:  # streaming or not: never started, so a real status
        assert queued.status_code == 503 and queued.headers.get("retry-after"), queued.text
        assert queued.json()["error"]["type"] == "server_shutting_down"


@pytest.mark.parametrize("slow_engine", [0.02], indirect=True)
def test_what_outlives_the_drain_ends_with_a_503_event(slow_engine, tiny_model_dir):
    settings = Settings(model=tiny_model_dir, served_model_name=["tiny"], drain_timeout=0.3)
    app = served_app(slow_engine, settings)
    with ServedInThread(app) as url:
        results, threads = run_in_threads(url, [{**LONG, "n": 4}, {**LONG, "n": 4, "stream": True}])
        wait_running(slow_engine, 2, 0)
        started = time.monotonic()
        app.drain()
        for thread in threads:
            thread.join(60)
    assert time.monotonic() - started < 5  # 120 steps of 20 ms would take 2.4 s and more
    plain, stream = results
    assert plain.status_code == 503 and plain.json()["error"]["type"] == "server_shutting_down"
    events = sse_events(stream.text)
    assert stream.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 503  # the closing event says why
