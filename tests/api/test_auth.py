"""With --api-key, every route but the public ones needs `Authorization: Bearer <key>` (401 otherwise)."""

from __future__ import annotations

import falcon.testing

from gyrfalcon.api.app import create_app
from gyrfalcon.config import Settings
from gyrfalcon.plugins import plugin_manager


def test_api_key_required(tiny_engine, tiny_model_dir):
    app = create_app(tiny_engine, Settings(model=tiny_model_dir, api_keys=["s3cret"]), plugin_manager())
    client = falcon.testing.TestClient(app)
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
