"""The service around the endpoints: model listing, health, unknown models and routes, and the
error envelope every OpenAI client parses."""

from __future__ import annotations

from gyrfalcon.check.registry import Unsupported, check
from gyrfalcon.check.semantics.flavours import expect
from gyrfalcon.check.target import refused


@check("models")
def models_listed(target):
    """GET /v1/models: a list object whose data are model objects with ids (the checked one among them)."""
    r = target.get("/v1/models")
    expect(r.status == 200, r.describe())
    data = r.json.get("data") if isinstance(r.json, dict) else None
    expect(r.json.get("object") == "list" and isinstance(data, list) and data, f"not a model list: {str(r.json)[:200]}")
    expect(all(isinstance(m.get("id"), str) and m.get("object") == "model" for m in data), f"model entries {str(data)[:200]}")
    expect(target.model in [m["id"] for m in data], f"{target.model!r} is not listed")


@check("models", "health")
def health_answers(target):
    """GET /health answers 200 on a server that is serving (a server without the route is unsupported)."""
    r = target.get("/health")
    if r.status in (404, 405):
        raise Unsupported(f"GET /health: the route is missing ({r.status})")
    expect(r.status == 200, r.describe())


@check("models")
def unknown_model_is_404(target):
    """A model the server does not serve is a 404 error (OpenAI's model_not_found), not an answer from
    another model."""
    r = target.post("/v1/completions", {"model": "gyrfalcon-check-no-such-model", "prompt": "hi", "max_tokens": 1})
    expect(r.status == 404 and isinstance(r.error().get("message"), str),
           f"an unknown model: {r.describe()} (expected a 404 error)")  # fmt: skip


@check("models")
def unknown_route_is_404(target):
    """A route the server does not have is a 404."""
    r = target.get("/v1/gyrfalcon-check-no-such-route")
    expect(r.status == 404, r.describe())


@check("models")
def error_envelope(target):
    """A body that is not JSON is a 400 in OpenAI's error envelope: error.message and error.type."""
    r = target.request("POST", "/v1/completions", raw=b'{"model": "x", "prompt": ')
    expect(r.status == 400, f"a truncated JSON body: {r.describe()} (expected 400)")
    error = r.error()
    expect(isinstance(error.get("message"), str) and isinstance(error.get("type"), str),
           f"not OpenAI's error envelope: {r.raw[:200]!r}")  # fmt: skip


@check("models", "strict_fields")
def unknown_field_named(target):
    """A field the server does not know is refused with a 400 naming it, never silently dropped."""
    refused(target.post("/v1/completions", {"model": target.model, "prompt": "hi", "max_tokens": 1,
                                             "gyrfalcon_check_unknown": 1}), "gyrfalcon_check_unknown")  # fmt: skip
