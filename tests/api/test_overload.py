"""A full engine queue is a 503 with ``Retry-After`` and the error envelope (typed engine errors
become HTTP answers in the API layer only)."""

from __future__ import annotations

from gyrfalcon.config import Settings
from gyrfalcon.plugins.engines import create_transformers_engine
from gyrfalcon.engine_api.types import EngineRequest, SamplingParams
from tests.conftest import tiny_settings
from tests.helpers import api_client, served_app


def test_a_full_queue_is_503_with_retry_after(tiny_model_dir):
    engine = create_transformers_engine(tiny_settings(tiny_model_dir, max_queue_len=1, max_num_seqs=1), start=False)
    assert engine.core.prepare()  # ready, but no loop runs: what is queued stays queued
    try:
        # the first takes the one free seat at the next step, the second waits: the queue is full
        fillers = [engine.submit(EngineRequest(f"filler-{i}", [1, 2, 3], SamplingParams(max_tokens=2))) for i in range(2)]
        app = served_app(engine, Settings(model=tiny_model_dir, served_model_name=["tiny"]))
        client = api_client(app)
        r = client.simulate_post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json["error"]["type"] == "server_overloaded" and r.json["error"]["code"] == 503
        assert "busy" in r.json["error"]["message"]
    finally:
        engine.shutdown(0)
    assert all(list(waiting)[-1].outputs[0].finish_reason == "abort" for waiting in fillers)
