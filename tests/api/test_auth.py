"""With --api-key, every route but the public ones needs `Authorization: Bearer <key>` (401 otherwise)."""

from __future__ import annotations

from gyrfalcon.config import Settings
from tests.helpers import api_client, served_app


def test_api_key_required(tiny_engine, tiny_model_dir):
    app = served_app(tiny_engine, Settings(model=tiny_model_dir, api_keys=["s3cret"]))
    client = api_client(app)
    body = {"prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}, {"Authorization": "Basic s3cret"},
                    {"Authorization": "Bearer"}, {"Authorization": "Bearers3cret"}):  # fmt: skip
        r = client.simulate_post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json["error"]["code"] == 401, headers
        assert r.headers["www-authenticate"] == "Bearer"
    for good in ("Bearer s3cret", "bearer s3cret", "BEARER  s3cret "):  # the scheme is case-insensitive
        assert client.simulate_post("/v1/completions", json=body, headers={"Authorization": good}).status_code == 200
    assert client.simulate_get("/v1/models").status_code == 401
    for public in ("/health", "/version", "/openapi.json", "/metrics"):
        assert client.simulate_get(public).status_code == 200, public


def test_metrics_may_ask_for_a_key(tiny_engine, tiny_model_dir):
    settings = Settings(model=tiny_model_dir, api_keys=["s3cret"], metrics_require_key=True)
    client = api_client(served_app(tiny_engine, settings))
    assert client.simulate_get("/metrics").status_code == 401
    assert client.simulate_get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.simulate_get("/health").status_code == 200


def test_cors_for_the_allowed_origins_and_preflights_need_no_key(tiny_engine, tiny_model_dir):
    settings = Settings(model=tiny_model_dir, api_keys=["s3cret"], allowed_origins=["https://ui.example"])
    client = api_client(served_app(tiny_engine, settings))
    preflight = client.simulate_options("/v1/completions", headers={
        "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})  # fmt: skip
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://ui.example"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    body = {"prompt": "x", "max_tokens": 1}
    r = client.simulate_post("/v1/completions", json=body, headers={"Origin": "https://ui.example", "Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    assert "X-Request-Id" in r.headers["access-control-expose-headers"]
    other = client.simulate_post("/v1/completions", json=body, headers={"Origin": "https://evil.example", "Authorization": "Bearer s3cret"})
    assert "access-control-allow-origin" not in other.headers
    plain = api_client(served_app(tiny_engine, Settings(model=tiny_model_dir)))
    assert "access-control-allow-origin" not in plain.simulate_get("/v1/models", headers={"Origin": "https://ui.example"}).headers
