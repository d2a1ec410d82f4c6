"""While the model loads, /health and every model-dependent route answer 503 with Retry-After."""

from __future__ import annotations

from gyrfalcon.plugins import plugin_manager
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.conftest import tiny_settings
from tests.helpers import api_client, served_app


def test_503_until_ready_then_200(tiny_model_dir):
    settings = tiny_settings(tiny_model_dir)
    pm = plugin_manager()
    engine = create_transformers_engine(settings, pm, start=False)
    client = api_client(served_app(engine, settings, pm))
    try:
        for method, path, body in [("GET", "/health", None), ("GET", "/openapi.json", None), ("GET", "/v1/models", None),
                                   ("POST", "/v1/completions", {"prompt": "x"})]:  # fmt: skip
            r = client.simulate_request(method, path, json=body)
            assert r.status_code == 503, (path, r.text)
            assert r.headers["retry-after"] == "1" and r.json["error"]["code"] == 503
        assert client.simulate_get("/version").status_code == 200
        engine.core.start()
        assert engine.wait_ready(60).ready
        assert client.simulate_get("/health").json == {"status": "ok", "decode_path": "eager (--enforce-eager)",
                                                       "weight_version": "default"}  # fmt: skip
        assert client.simulate_post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        engine.shutdown(grace=1.0)
