"""``null`` means "not set" for every optional request field, as the OpenAI SDK and vLLM's clients
send it: in the spec (every optional property of every request schema accepts null) and at run time
(a body whose optional fields are all null answers as the body without them)."""

from __future__ import annotations

import jsonschema
import pytest

from gyrfalcon.openapi.served import bundle, request_schema_names

# the fields each case sets, beyond its required ones: a greedy, short, deterministic request
FIXED = {"temperature", "max_tokens", "ignore_eos"}
MESSAGES = [{"role": "user", "content": "hello", "name": None}]

CASES = {
    "CompletionRequest": ("/v1/completions", {"prompt": "hello there"}),
    "ChatCompletionRequest": ("/v1/chat/completions", {"messages": MESSAGES}),
    "BatchChatCompletionRequest": ("/v1/chat/completions/batch", {"messages": [MESSAGES, MESSAGES]}),
}


def _accepts_null(spec: dict, schema_name: str, prop: str) -> bool:
    pointer = {**spec, "$ref": f"#/components/schemas/{schema_name}/properties/{prop}"}
    return jsonschema.Draft202012Validator(pointer).is_valid(None)


def test_every_optional_request_property_accepts_null_in_the_spec():
    spec = bundle()
    schemas = spec["components"]["schemas"]
    checked = 0
    for name in request_schema_names(spec):
        required = set(schemas[name].get("required", []))
        for prop in schemas[name].get("properties", {}):
            if prop in required:
                assert not _accepts_null(spec, name, prop), f"{name}.{prop} is required but accepts null"
                continue
            assert _accepts_null(spec, name, prop), f"{name}.{prop} is optional but refuses null"
            checked += 1
    assert checked > 100  # every endpoint's fields, generate's sampling_params and stream_options included


def _optional(schema_name: str) -> list[str]:
    schema = bundle()["components"]["schemas"][schema_name]
    return [p for p in schema["properties"] if p not in set(schema.get("required", []))]


def _answers(response) -> list:
    body = response.json
    return [{k: c.get(k) for k in ("index", "text", "message", "token_ids", "finish_reason")} for c in body["choices"]]


@pytest.mark.parametrize("schema_name", sorted(CASES))
def test_a_body_of_nulls_answers_as_the_body_without_them(client, schema_name):
    path, required = CASES[schema_name]
    fixed = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
    plain = client.simulate_post(path, json={**required, **fixed})
    assert plain.status_code == 200, plain.text
    nulls = {name: None for name in _optional(schema_name) if name not in FIXED}
    assert {"n", "stream", "stream_options", "logprobs", "seed", "stop", "echo", "user"} & set(nulls)
    sent = client.simulate_post(path, json={**required, **fixed, **nulls})
    assert sent.status_code == 200, sent.text
    assert _answers(sent) == _answers(plain)


def test_generate_takes_nulls_at_the_top_and_in_sampling_params(client):
    fixed = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
    plain = client.simulate_post("/inference/v1/generate", json={"token_ids": [5, 6, 7], "sampling_params": fixed})
    assert plain.status_code == 200, plain.text
    top = {name: None for name in _optional("GenerateRequest") if name != "sampling_params"}
    params = {name: None for name in _optional("GenerateSamplingParams") if name not in FIXED}
    assert {"seed", "stop", "n", "logprobs"} <= set(params)
    sent = client.simulate_post("/inference/v1/generate",
                                json={"token_ids": [5, 6, 7], "sampling_params": {**fixed, **params}, **top})  # fmt: skip
    assert sent.status_code == 200, sent.text
    assert _answers(sent) == _answers(plain)
    whole = client.simulate_post("/inference/v1/generate", json={"token_ids": [5, 6, 7], "sampling_params": None})
    assert whole.status_code == 200, whole.text


def test_tokenize_and_detokenize_take_nulls(client):
    plain = client.simulate_post("/tokenize", json={"prompt": "hello"}).json
    nulls = client.simulate_post("/tokenize", json={"prompt": "hello", "model": None, "add_special_tokens": None})
    assert nulls.status_code == 200 and nulls.json == plain
    chat = client.simulate_post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": None})
    assert chat.json == client.simulate_post("/tokenize", json={"messages": MESSAGES[:1]}).json
    back = client.simulate_post("/detokenize", json={"tokens": plain["tokens"], "model": None})
    assert back.status_code == 200


def test_null_is_not_a_value_where_a_rule_needs_one(client):
    """A rule that needs a field set is not met by null: logprob_token_ids still needs logprobs."""
    r = client.simulate_post("/v1/completions",
                             json={"prompt": "hi", "logprob_token_ids": [3], "logprobs": None})  # fmt: skip
    assert r.status_code == 400 and r.json["error"]["param"] == "logprob_token_ids"
