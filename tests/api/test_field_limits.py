"""The served spec's bounds are exactly what the code accepts: for every bounded numeric request
field of every endpoint, its bound is accepted and one step past it is a 400 naming the field; the
same for token ids (the vocabulary), logit_bias keys and the number of prompts. The deployment
bounds come from one table (``gyrfalcon.openapi.limits``) that writes the spec and is enforced at
the translation boundary; this proves the two never drift."""

from __future__ import annotations

from typing import Any

import pytest

from gyrfalcon.openapi import FIELD_LIMITS
from gyrfalcon.plugins import plugin_manager
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.conftest import TINY_MAX_MODEL_LEN, tiny_settings
from tests.helpers import api_client, served_app


MSG = {"role": "user", "content": "hi"}
#: endpoint -> (request schema, minimal valid body, where its sampling fields go)
ENDPOINTS = {
    "/inference/v1/generate": ("GenerateSamplingParams", {"token_ids": [1], "sampling_params": {"max_tokens": 1}}),
    "/v1/completions": ("CompletionRequest", {"prompt": [1], "max_tokens": 1}),
    "/v1/chat/completions": ("ChatCompletionRequest", {"messages": [MSG], "max_tokens": 1}),
    "/v1/chat/completions/batch": ("BatchChatCompletionRequest", {"messages": [[MSG]], "max_tokens": 1}),
}
#: fields that mean something only with another one set (each its own cross-field rule)
COMPANIONS = {"top_logprobs": {"logprobs": True}, "n": {"temperature": 1.0}, "min_tokens": "max_tokens",
              "max_tokens": {"echo": True}, "logprob_token_ids": {"logprobs": 0}}  # fmt: skip


@pytest.fixture(scope="module")
def small(tiny_model_dir):
    """A server with small limits of every kind (6 sequences, 4 prompts, 5 logprobs)."""
    settings = tiny_settings(tiny_model_dir, served_model_name=["tiny"], max_queue_len=4, max_request_seqs=6,
                             max_logprobs=5)  # fmt: skip
    pm = plugin_manager()
    engine = create_transformers_engine(settings, pm)
    assert engine.wait_ready(60).ready
    client = api_client(served_app(engine, settings, pm))
    yield client, client.simulate_get("/openapi.json").json
    engine.shutdown(0)


def body_with(path: str, name: str, value: Any) -> tuple[dict[str, Any], str]:
    """The endpoint's minimal body with ``name`` set to ``value`` (and its companions); the param."""
    body = {k: (dict(v) if isinstance(v, dict) else v) for k, v in ENDPOINTS[path][1].items()}
    fields = body["sampling_params"] if "sampling_params" in body else body
    companion = COMPANIONS.get(name, {})
    if companion == "max_tokens":
        companion = {"max_tokens": min(max(value, 1), TINY_MAX_MODEL_LEN - 1)}
    if name == "max_tokens" and path != "/v1/completions":
        companion = {}
    if "logprobs" in companion and path in ("/v1/chat/completions", "/v1/chat/completions/batch"):
        companion = {"logprobs": True}
    fields.update(companion)
    fields[name] = value
    return body, (f"sampling_params.{name}" if "sampling_params" in body else name)


def numeric_bounds(spec: dict[str, Any], schema: str) -> list[tuple[str, str, float]]:
    """(field, keyword, bound) of every numeric bound on a request schema's own properties."""
    found = []
    for name, prop in spec["components"]["schemas"][schema]["properties"].items():
        for variant in [prop, *prop.get("oneOf", [])]:
            if "enum" in variant or "const" in variant:
                continue
            for keyword in ("minimum", "maximum", "exclusiveMinimum"):
                if keyword in variant and variant.get("type") in ("integer", "number", ["integer", "null"], ["number", "null"]):
                    found.append((name, keyword, variant[keyword]))
    return found


def refused_naming(response, param: str) -> bool:
    return response.status_code == 400 and (response.json["error"]["param"] or "").startswith(param)


def context_refusal(response) -> bool:
    """The runtime rule prompt_fits_context: the spec bounds max_tokens for a one-token prompt, the
    exact bound depends on the rendered prompt's length."""
    return response.status_code == 400 and response.json["error"]["message"].startswith("This model's context is")


CASES = [(path, schema) for path, (schema, _) in ENDPOINTS.items()]


@pytest.mark.parametrize("path, schema", CASES)
def test_every_numeric_bound_is_the_codes(small, path, schema):
    client, spec = small
    bounds = numeric_bounds(spec, schema)
    assert {"n", "max_tokens", "logprobs" if "Chat" not in schema else "top_logprobs"} <= {b[0] for b in bounds}
    for name, keyword, bound in bounds:
        step = 1 if isinstance(bound, int) else 1e-6 * max(1.0, abs(bound))
        inside = bound if keyword != "exclusiveMinimum" else bound + step
        outside = bound + step if keyword == "maximum" else bound - step if keyword == "minimum" else bound
        if name == "seed" or abs(bound) >= 2**31:
            continue  # int64 and int32 edges: one past them is not an int64 / fails the wire type first
        body, param = body_with(path, name, inside)
        ok = client.simulate_post(path, json=body)
        assert not refused_naming(ok, param) or context_refusal(ok), (name, keyword, inside, ok.text)
        body, param = body_with(path, name, outside)
        assert refused_naming(client.simulate_post(path, json=body), param), (name, keyword, outside)


def test_token_ids_logit_bias_keys_and_prompt_count(small):
    client, spec = small
    vocab = spec["x-limits"]["vocab_size"]
    for path, field in (("/v1/completions", "prompt"), ("/inference/v1/generate", "token_ids")):
        body = dict(ENDPOINTS[path][1])
        assert client.simulate_post(path, json={**body, field: [vocab - 1]}).status_code == 200
        assert refused_naming(client.simulate_post(path, json={**body, field: [vocab]}), field)
    for ids_field in ("stop_token_ids", "allowed_token_ids"):
        for value, accepted in (([vocab - 1], True), ([vocab], False)):
            body, param = body_with("/inference/v1/generate", ids_field, value)
            assert refused_naming(client.simulate_post("/inference/v1/generate", json=body), param) is not accepted
    for key, accepted in ((str(vocab - 1), True), (str(vocab), False)):
        r = client.simulate_post("/v1/completions", json={"prompt": [1], "max_tokens": 1, "logit_bias": {key: 1}})
        assert refused_naming(r, "logit_bias") is not accepted, r.text
    prompts = spec["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    most = max(v.get("maxItems", 0) for v in prompts["oneOf"] if v.get("type") == "array" and v["items"].get("type") == "string")
    assert most == 4  # min(max_queue_len, max_request_seqs)
    assert client.simulate_post("/v1/completions", json={"prompt": ["a"] * most, "max_tokens": 1}).status_code == 200
    assert refused_naming(client.simulate_post("/v1/completions", json={"prompt": ["a"] * (most + 1), "max_tokens": 1}), "prompt")


def test_the_table_covers_every_deployment_bound_the_spec_states():
    bounded = {name for limit in FIELD_LIMITS for name in limit.fields}
    assert {"n", "max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs",
            "token_ids", "prompt", "stop_token_ids", "allowed_token_ids", "logprob_token_ids", "logit_bias",
            "messages", "tokens"} == bounded  # fmt: skip


def test_an_array_no_field_takes_is_refused_before_the_body_is_walked(small):
    client, spec = small
    longest = spec["x-limits"]["max_model_len"]
    for path, body in (("/v1/completions", {"prompt": [1] * 200_000, "max_tokens": 1}),
                       ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"stop_token_ids": [1.0] * 5000}})):  # fmt: skip
        r = client.simulate_post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json["error"]["param"] in ("prompt", "sampling_params.stop_token_ids") and "no request field" in r.text
    # the longest an array may be: a prompt of the whole context, as ids, reaches the translator's own check
    r = client.simulate_post("/v1/completions", json={"prompt": [1] * (longest + 1), "max_tokens": 1})
    assert r.status_code == 400 and r.json["error"]["param"] == "prompt"
