"""Structured outputs through the API: response_format and structured_outputs on every endpoint,
with n > 1, seeds and logprobs; a bad constraint is a 400 naming its field."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from tests.helpers import random_schema, sse_events, stream_by_choice

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "tags": {"type": "array", "items": {"enum": ["a", "b", None]}, "maxItems": 3}},
    "required": ["name", "age"],
    "additionalProperties": False,
}  # fmt: skip


def ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json


def refused(r, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json["error"]["param"] == param, r.json


def _chat(client, **body):
    return client.simulate_post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                                              **body})  # fmt: skip


def test_chat_json_schema_every_choice_valid_or_cut(client):
    body = ok(_chat(client, n=4, seed=3, temperature=1.0, max_tokens=60,
                    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}))  # fmt: skip
    assert len(body["choices"]) == 4
    finished = 0
    for choice in body["choices"]:
        text = choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(text), PERSON)
            finished += 1
        else:
            assert choice["finish_reason"] == "length" and text.startswith("{")
    assert finished >= 1


def test_null_inside_a_schema_is_kept(client):
    schema = {"type": "object", "properties": {"x": {"const": None}}, "required": ["x"], "additionalProperties": False}
    body = ok(_chat(client, max_tokens=20, temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}))
    assert json.loads(body["choices"][0]["message"]["content"]) == {"x": None}


def test_completions_regex_choice_and_json_object(client):
    regex = r"[a-c]{2}-[0-9]{3}"
    body = ok(client.simulate_post("/v1/completions", json={"model": "tiny", "prompt": "Code:", "n": 3, "seed": 1, "max_tokens": 20,
                                                            "structured_outputs": {"regex": regex}}))  # fmt: skip
    assert all(re.fullmatch(regex, c["text"]) for c in body["choices"])
    body = ok(client.simulate_post("/v1/completions", json={"model": "tiny", "prompt": "Pick:", "max_tokens": 10, "temperature": 0,
                                                            "structured_outputs": {"choice": ["red", "green", "blue"]}}))  # fmt: skip
    assert body["choices"][0]["text"] in ("red", "green", "blue")
    body = ok(client.simulate_post("/v1/completions", json={"model": "tiny", "prompt": "{", "max_tokens": 40, "seed": 2,
                                                            "response_format": {"type": "json_object"}}))  # fmt: skip
    choice = body["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)


def test_generate_grammar_with_logprobs_and_the_same_tokens_for_the_same_seed(client):
    grammar = 'start: "x" ("y" | "z")+ "!"'
    request = {"model": "tiny", "token_ids": [5, 6, 7], "stream": False,
               "sampling_params": {"n": 2, "seed": 9, "max_tokens": 12, "logprobs": 2, "detokenize": True,
                                   "structured_outputs": {"grammar": grammar}}}  # fmt: skip
    first = ok(client.simulate_post("/inference/v1/generate", json=request))
    again = ok(client.simulate_post("/inference/v1/generate", json=request))
    assert [c["token_ids"] for c in first["choices"]] == [c["token_ids"] for c in again["choices"]]
    for choice in first["choices"]:
        assert len(choice["logprobs"]["content"] if isinstance(choice["logprobs"], dict) else choice["logprobs"]) == len(choice["token_ids"])


def test_streamed_choices_follow_the_constraint(client):
    r = client.simulate_post("/v1/completions", json={"model": "tiny", "prompt": "Pick:", "n": 3, "seed": 4, "max_tokens": 10,
                                                      "stream": True, "structured_outputs": {"choice": ["yes", "no"]}})  # fmt: skip
    by_choice = stream_by_choice(sse_events(r.text))
    assert sorted(by_choice) == [0, 1, 2]
    assert all(c["text"] in ("yes", "no") and c["finishes"] == ["stop"] for c in by_choice.values())


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a["}}, "structured_outputs.regex"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "start: ???"}}, "structured_outputs.grammar"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": {"type": "foo"}}}, "structured_outputs.json"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "structured_outputs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
         "response_format.json_schema.schema"),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"structured_outputs": {"regex": "("}}},
         "sampling_params.structured_outputs.regex"),
        # malformed structural tags: a begin that is not a string was an uncaught AttributeError (a 500)
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"structural_tag": json.dumps(
            {"structures": [{"begin": 3, "end": "</f>"}], "triggers": ["<f>"]})}}, "structured_outputs.structural_tag"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"structural_tag": json.dumps(
            {"structures": [7], "triggers": ["<f>"]})}}, "structured_outputs.structural_tag"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"structural_tag": "[]"}}, "structured_outputs.structural_tag"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_its_field(client, path, body, param):
    refused(client.simulate_post(path, json={"model": "tiny", **body}), param)


def test_the_served_spec_states_the_constraints_bounds(client):
    from gyrfalcon.structured.grammar import MAX_CONSTRAINT_BYTES, MAX_CONSTRAINT_NODES

    limits = client.simulate_get("/openapi.json").json["x-limits"]["constraints"]
    assert limits == {"max_bytes": MAX_CONSTRAINT_BYTES, "max_nodes": MAX_CONSTRAINT_NODES}


def test_structural_tag_is_compiled_and_checked(client):
    def tag(schema):
        return json.dumps({"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f>"]})

    good = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
    body = ok(client.simulate_post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 60, "seed": 3,
                                                            "structured_outputs": {"structural_tag": tag(good)}}))  # fmt: skip
    for inside in re.findall(r"<f>(.*?)</f>", body["choices"][0]["text"], re.S):  # free text outside the tags
        assert json.loads(inside)["a"] in (1, 2)
    refused(client.simulate_post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4,
                                                          "structured_outputs": {"structural_tag": tag({"type": "nope"})}}),
            "structured_outputs.structural_tag")  # fmt: skip
    refused(client.simulate_post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4,
                                                          "structured_outputs": {"structural_tag": "{not json"}}),
            "structured_outputs.structural_tag")  # fmt: skip


def test_text_response_format_asks_for_nothing(client):
    ok(_chat(client, max_tokens=2, response_format={"type": "text"}))


def test_one_hundred_generated_schemas_greedy_and_sampled(client, tiny_model_dir):
    """Every output that finished with stop validates (jsonschema, independently); every one cut by
    max_tokens is a prefix the schema's grammar still accepts."""
    import llguidance
    import llguidance.hf

    from gyrfalcon.structured.grammar import check

    rng = random.Random(7)
    tokenizer = None
    outcomes = {"stop": 0, "length": 0}
    for i in range(100):
        schema = random_schema(rng)
        sampling = {"temperature": 0} if i % 2 else {"seed": i, "temperature": 1.0}
        body = ok(client.simulate_post("/v1/completions", json={"model": "tiny", "prompt": "JSON:", "max_tokens": 60,
                                                                "return_token_ids": True, **sampling,
                                                                "structured_outputs": {"json": schema}}))  # fmt: skip
        choice = body["choices"][0]
        outcomes[choice["finish_reason"]] += 1
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["text"]), schema)
            continue
        if tokenizer is None:
            from gyrfalcon.models.loading import load_tokenizer

            tokenizer = llguidance.hf.from_tokenizer(load_tokenizer(tiny_model_dir), eos_token=[2])
        matcher = llguidance.LLMatcher(tokenizer, check({"json": schema}))
        assert matcher.consume_tokens(choice["token_ids"]) and not matcher.is_error(), (schema, choice["text"])
    assert outcomes["stop"] >= 50, outcomes


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_allowed_token_ids_exclude_is_a_400_naming_the_grammar(client, stream):
    """Rule constraints_leave_a_token: the regex needs a digit first, allowed_token_ids offer none; a
    stream sends its status with its first event, so it too is refused before any 200."""
    r = client.simulate_post("/v1/completions", json={"model": "tiny", "prompt": "Code:", "max_tokens": 5, "stream": stream,
                                                      "allowed_token_ids": [0], "structured_outputs": {"regex": "[0-9]+"}})  # fmt: skip
    refused(r, "structured_outputs")
    assert "every token is excluded" in r.json["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_in_band_constraint_error_names_response_format_when_the_constraint_came_from_there(client, stream):
    """The engine's error names ``structured_outputs``; the client wrote ``response_format``."""
    r = _chat(client, max_tokens=5, stream=stream, allowed_token_ids=[0],
              response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}})  # fmt: skip
    refused(r, "response_format")
    assert "every token is excluded" in r.json["error"]["message"]
