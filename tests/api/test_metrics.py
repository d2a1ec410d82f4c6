"""/metrics: prometheus-client's exposition, parsed by its own parser; counters and histograms move
by exactly what a burst of requests did; the engine's gauges are there under vLLM's names."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gyrfalcon.api import resources
from tests.helpers import sse_events

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "gyrfalcon-dashboard.json"


@pytest.fixture(autouse=True)
def fresh_metrics(monkeypatch):
    """These tests read what each request moved: every scrape renders anew (the server's answers
    may be up to resources.METRICS_MAX_AGE_S old: test_a_scrape_within_a_second_is_the_last_render)."""
    monkeypatch.setattr(resources, "METRICS_MAX_AGE_S", 0.0)


def test_a_scrape_within_a_second_is_the_last_render(client, tiny_engine, monkeypatch):
    """Scrapes within METRICS_MAX_AGE_S share one render (one engine call), off the requests' pool."""
    monkeypatch.setattr(resources, "METRICS_MAX_AGE_S", 60.0)
    calls = []
    stats = tiny_engine.stats
    monkeypatch.setattr(tiny_engine, "stats", lambda: calls.append(1) or stats())
    first = client.simulate_get("/metrics").text
    assert client.simulate_post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    assert [client.simulate_get("/metrics").text for _ in range(5)] == [first] * 5
    assert len(calls) <= 1


def scrape(client, model_name: str) -> dict[str, float]:
    """Every sample of ``model_name``'s series (and the unlabelled), by name and other labels."""
    r = client.simulate_get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            if sample.labels.get("model_name", model_name) != model_name:
                continue
            key = sample.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
            samples[key] = sample.value
    return samples


def delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_a_burst_moves_every_counter_by_what_it_did(client, tiny_engine):
    before = scrape(client, tiny_engine.model_name)
    prompts = []
    for i in range(3):
        r = client.simulate_post("/v1/completions", json={"prompt": f"count {i}", "max_tokens": 5, "n": 2,
                                                          "temperature": 1.0, "seed": i, "ignore_eos": True})  # fmt: skip
        assert r.status_code == 200
        prompts.append(r.json["usage"]["prompt_tokens"])
    r = client.simulate_post("/v1/completions", json={"prompt": "stream it", "max_tokens": 7, "temperature": 0,
                                                      "ignore_eos": True, "stream": True,
                                                      "stream_options": {"include_usage": True}})  # fmt: skip
    usage = sse_events(r.text)[-2]["usage"]
    prompts.append(usage["prompt_tokens"])
    after = scrape(client, tiny_engine.model_name)
    assert delta(before, after, "gyrfalcon:request_success_total{finished_reason=length}") == 3 * 2 + 1
    assert delta(before, after, "gyrfalcon:generation_tokens_total") == 3 * 2 * 5 + 7
    assert delta(before, after, "gyrfalcon:prompt_tokens_total") == sum(prompts)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert delta(before, after, f"gyrfalcon:{name}_count") == 4, name
    assert delta(before, after, "gyrfalcon:request_generation_tokens_sum") == 3 * 2 * 5 + 7
    assert delta(before, after, "gyrfalcon:request_params_n_sum") == 3 * 2 + 1
    # the n=1 stream: 7 tokens are one first token and 6 gaps (the n=2 requests add theirs)
    assert delta(before, after, "gyrfalcon:inter_token_latency_seconds_count") >= 6
    # histogram buckets are vLLM's
    assert "gyrfalcon:time_to_first_token_seconds_bucket{le=2560.0}" in after
    assert "gyrfalcon:e2e_request_latency_seconds_bucket{le=7680.0}" in after
    # the engine's own count follows its output by a moment (the request is forgotten after it)
    deadline = time.monotonic() + 5
    while delta(before, after, "gyrfalcon_requests_finished_total") < 4 and time.monotonic() < deadline:
        after = scrape(client, tiny_engine.model_name)
    assert delta(before, after, "gyrfalcon_requests_finished_total") == 4


def test_engine_gauges_under_vllms_names(client, tiny_engine):
    samples = scrape(client, tiny_engine.model_name)
    assert samples["gyrfalcon:num_requests_running"] >= 0 and samples["gyrfalcon:num_requests_waiting"] >= 0
    assert 0 <= samples["gyrfalcon:kv_cache_usage_perc"] <= 1
    for name in ("num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert f"gyrfalcon:{name}" in samples, name
    assert samples["gyrfalcon_pid"] > 0
    assert samples["gyrfalcon_decode_path{path=eager,reason=--enforce-eager}"] == 1  # which path runs, and why


def test_every_series_the_dashboard_queries_is_served(client, tiny_engine):
    """The Grafana dashboard in examples/ (vLLM's panels, prefix gyrfalcon:) finds its series."""
    import re

    client.simulate_post("/v1/completions", json={"prompt": "x", "max_tokens": 2})  # every histogram has a sample
    served = {key.split("{")[0] for key in scrape(client, tiny_engine.model_name)}
    exprs = [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel.get("targets", [])]
    assert len(exprs) >= 8
    for expr in exprs:
        for name in re.findall(r"gyrfalcon:[a-z0-9_]+", expr):
            assert name in served, (name, expr)
