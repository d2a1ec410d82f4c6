"""The OpenAPI contract: documents, x-rule if/then blocks, the bundle, the served overlay, codegen."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest

from gyrfalcon import codegen
from gyrfalcon.openapi import (
    DOCUMENTS,
    OPENAPI_DIR,
    ServedLimits,
    bundle,
    request_field_names,
    request_schema_names,
    rule_ids,
    served_spec,
    x_rules,
)
from gyrfalcon.openapi.limits import decimal_range_pattern, walk_schemas
from gyrfalcon.protocol.endpoints import CONTROL_ROUTES, LORA_ROUTES
from gyrfalcon.protocol.runtime_rules import served_table

REQUESTS = ("GenerateRequest", "CompletionRequest", "ChatCompletionRequest", "BatchChatCompletionRequest")
UNSUPPORTED = {"presence_penalty", "logprobs", "top_logprobs", "use_beam_search", "logit_bias", "logprob_token_ids"}
LIMITS = ServedLimits(model_names=["tiny", "tiny-alias"], vocab_size=512, max_model_len=128, max_request_seqs=8, max_logprobs=5)
PLUGIN = {"type": "object", "additionalProperties": False, "properties": {"level": {"type": "integer", "minimum": 0}}}

EXPECTED_RULES = {
    "ResponsesRequest": {"logprob_token_ids_requires_logprobs"},
    "GenerateRequest": {"stream_options_requires_stream", "prompt_logprobs_not_streaming"},
    "GenerateSamplingParams": {"n_greedy", "logprob_token_ids_requires_logprobs", "stop_requires_detokenize"},
    "CompletionRequest": {
        "stream_options_requires_stream", "prompt_logprobs_not_streaming", "n_greedy",
        "logprob_token_ids_requires_logprobs", "logprob_token_ids_not_beam_search",
        "logprob_token_ids_not_echo_without_tokens", "max_tokens_zero_requires_echo",
        "return_tokens_as_token_ids_requires_logprobs",
    },
    "ChatCompletionRequest": {
        "stream_options_requires_stream", "prompt_logprobs_not_streaming", "n_greedy",
        "top_logprobs_requires_logprobs", "logprob_token_ids_requires_logprobs", "logprob_token_ids_not_beam_search",
        "return_tokens_as_token_ids_requires_logprobs",
    },
    "BatchChatCompletionRequest": {
        "top_logprobs_requires_logprobs", "logprob_token_ids_requires_logprobs", "logprob_token_ids_not_beam_search",
        "batch_chat_not_streaming", "return_tokens_as_token_ids_requires_logprobs",
    },
}  # fmt: skip


def validator(spec: dict[str, Any], name: str) -> jsonschema_rs.Draft202012Validator:
    """A Draft 2020-12 validator for one component schema (its $refs resolve inside ``spec``)."""
    return jsonschema_rs.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": spec["components"]})


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return bundle()


@pytest.fixture(scope="module")
def served() -> dict[str, Any]:
    limits = ServedLimits(**{**LIMITS.__dict__, "unsupported": set(UNSUPPORTED), "extensions": {"demo": PLUGIN}})
    return served_spec(limits, served_table())


# --- the documents ------------------------------------------------------------------------------


def test_documents_and_bundle_are_valid_openapi_31(spec: dict[str, Any], served: dict[str, Any]) -> None:
    ov = pytest.importorskip("openapi_spec_validator")
    import yaml

    for name in DOCUMENTS:
        path = OPENAPI_DIR / name
        ov.validate(yaml.safe_load(path.read_text()), base_uri=path.as_uri())
    ov.validate(spec)
    ov.validate(served)
    assert spec["openapi"] == served["openapi"] == "3.1.0"


def test_operations_and_statuses(spec: dict[str, Any]) -> None:
    ops = {op["operationId"]: (path, method, op) for path, item in spec["paths"].items() for method, op in item.items()}
    assert set(ops) == {"generate", "createCompletion", "createChatCompletion", "createBatchChatCompletion",
                        "listModels", "health", "version", "openapi", "tokenize", "detokenize", "metrics",
                        "createResponse", "getResponse", "deleteResponse", "listResponseInputItems",
                        "cancelResponse", "pause", "resume", "isPaused", "abortRequests", "updateWeightsFromDisk",
                        "weightVersion", "sleep", "wakeUp", "isSleeping", "loadLoraAdapter", "unloadLoraAdapter"}  # fmt: skip
    error_ref = "#/components/schemas/ErrorResponse"
    for op_id, (path, method, op) in ops.items():
        if path in CONTROL_ROUTES:  # no model and (but abort_requests) no body: no 404, 413 or 415
            assert {"200", "401", "503"} <= set(op["responses"]) and set(op["responses"]["200"]["content"]) == {
                "application/json"}, op_id  # fmt: skip
            continue
        if path in LORA_ROUTES:  # vLLM's answer, plain text; names no model
            assert {"200", "400", "401", "413", "415", "503"} <= set(op["responses"]), op_id
            assert set(op["responses"]["200"]["content"]) == {"text/plain"}, op_id
            continue
        if method != "post":
            continue
        assert {"200", "400", "401", "404", "413", "415", "503"} <= set(op["responses"]), op_id
        media = set(op["responses"]["200"]["content"])
        non_streaming = ("createBatchChatCompletion", "tokenize", "detokenize", "cancelResponse")
        assert media == ({"application/json"} if op_id in non_streaming else {"application/json", "text/event-stream"})
        if "text/event-stream" in media:
            assert op["responses"]["200"]["content"]["text/event-stream"]["schema"]["$ref"].endswith("/ServerSentEvent")
    assert "503" in ops["health"][2]["responses"]
    responses = spec["components"]["responses"]
    for name, response in responses.items():
        assert response["content"]["application/json"]["schema"]["$ref"] == error_ref, name
    assert "Retry-After" in responses["ServiceUnavailable"]["headers"]
    error = spec["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    event = spec["components"]["schemas"]["ServerSentEvent"]
    assert set(event["properties"]) == {"event", "data"} and event["required"] == ["data"]


def _walk_wire_objects(node: Any, where: str):
    """Every object schema of the wire shape (rule blocks under if/then/not are constraints, skipped)."""
    if isinstance(node, dict):
        if node.get("type") == "object" or "properties" in node:
            yield where, node
        for key, value in node.items():
            if key not in ("if", "then", "else", "not", "allOf"):
                yield from _walk_wire_objects(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk_wire_objects(value, f"{where}[{i}]")


def test_request_objects_are_closed_and_typed(spec: dict[str, Any]) -> None:
    schemas = spec["components"]["schemas"]
    names = request_schema_names(spec)
    assert set(REQUESTS) <= set(names)
    for name in names:
        for where, obj in _walk_wire_objects(schemas[name], name):
            extra = obj.get("additionalProperties")
            if extra is False or obj.get("x-json-schema") is True:  # a user's JSON schema is free-form
                continue
            # The only open objects are typed maps with constrained keys (logit_bias).
            assert isinstance(extra, dict) and "type" in extra and "propertyNames" in obj, where
        for prop, sub in schemas[name].get("properties", {}).items():
            assert "type" in sub or "$ref" in sub or "oneOf" in sub, f"{name}.{prop} is untyped"
    assert schemas["Extensions"] == {**schemas["Extensions"], "additionalProperties": False}
    assert "properties" not in schemas["Extensions"]


def test_shared_fields_are_identical_across_documents(spec: dict[str, Any]) -> None:
    """generate.yaml repeats the sampling fields of openai.yaml: they must not drift apart."""
    schemas = spec["components"]["schemas"]
    generate = schemas["GenerateSamplingParams"]["properties"]
    completion = schemas["CompletionRequest"]["properties"]
    differs_on_purpose = {"stop", "max_tokens", "logprobs", "logprob_token_ids", "n"}
    for name in set(generate) & set(completion) - differs_on_purpose:
        assert generate[name] == completion[name], name
    for name in ("model", "stream", "request_id", "cache_salt", "priority"):
        assert schemas["GenerateRequest"]["properties"][name] == completion[name], name
    assert generate["logprob_token_ids"]["items"] == completion["logprob_token_ids"]["items"]
    assert generate["stop"]["oneOf"] == completion["stop"]["oneOf"]  # null, one string, a list (vLLM)


def test_int64_seed_and_greedy_threshold(spec: dict[str, Any]) -> None:
    schemas = spec["components"]["schemas"]
    for name in ("GenerateSamplingParams", *REQUESTS[1:]):
        seed = schemas[name]["properties"]["seed"]
        assert (seed["minimum"], seed["maximum"], seed["format"]) == (-(2**63), 2**63 - 1, "int64")
    n_greedy = [b for b in schemas["CompletionRequest"]["allOf"] if b["x-rule"] == "n_greedy"][0]
    assert n_greedy["then"]["properties"]["temperature"]["minimum"] == 1e-5


# --- x-rule if/then blocks ----------------------------------------------------------------------


def test_rule_ids_are_where_they_belong(spec: dict[str, Any]) -> None:
    found: dict[str, set[str]] = {}
    for owner, rule in x_rules(spec):
        found.setdefault(owner, set()).add(rule)
    assert found == EXPECTED_RULES
    assert rule_ids(spec) == set().union(*EXPECTED_RULES.values())
    for name in EXPECTED_RULES:
        for block in spec["components"]["schemas"][name]["allOf"]:
            # the refusal's text, and the field it names where that is not the condition's first
            assert {"x-rule", "if", "then", "description"} <= set(block) <= {"x-rule", "if", "then", "description", "x-param"}
            # An `if` without `required` is vacuously true when the field is absent.
            assert block["if"].get("required"), block["x-rule"]


MSG = {"role": "user", "content": "hi"}
# (schema, body, valid?) -- bodies are otherwise valid, so each row isolates one rule.
RULE_CASES = {
    "stream_options_requires_stream": [
        ("GenerateRequest", {"token_ids": [1], "stream_options": {"include_usage": True}}, False),
        ("GenerateRequest", {"token_ids": [1], "stream_options": {}, "stream": False}, False),
        ("GenerateRequest", {"token_ids": [1], "stream_options": {}, "stream": True}, True),
        ("CompletionRequest", {"prompt": "a", "stream_options": {}}, False),
        ("CompletionRequest", {"prompt": "a", "stream_options": {}, "stream": True}, True),
        ("ChatCompletionRequest", {"messages": [MSG], "stream_options": {}}, False),
        ("ChatCompletionRequest", {"messages": [MSG], "stream_options": {}, "stream": True}, True),
        ("ChatCompletionRequest", {"messages": [MSG], "stream": True}, True),
    ],
    "prompt_logprobs_not_streaming": [
        ("GenerateRequest", {"token_ids": [1], "sampling_params": {"prompt_logprobs": 1}, "stream": True}, False),
        ("GenerateRequest", {"token_ids": [1], "sampling_params": {"prompt_logprobs": 1}, "stream": False}, True),
        ("GenerateRequest", {"token_ids": [1], "sampling_params": {"prompt_logprobs": 1}}, True),
        ("GenerateRequest", {"token_ids": [1], "sampling_params": {}, "stream": True}, True),
        ("CompletionRequest", {"prompt": "a", "prompt_logprobs": 0, "stream": True}, False),
        ("CompletionRequest", {"prompt": "a", "prompt_logprobs": 0}, True),
        ("ChatCompletionRequest", {"messages": [MSG], "prompt_logprobs": 2, "stream": True}, False),
        ("ChatCompletionRequest", {"messages": [MSG], "prompt_logprobs": 2, "stream": False}, True),
    ],
    "n_greedy": [
        ("GenerateSamplingParams", {"n": 2, "temperature": 0}, False),
        ("GenerateSamplingParams", {"n": 2, "temperature": 0.000001}, False),
        ("GenerateSamplingParams", {"n": 2, "temperature": 0.00001}, True),
        ("GenerateSamplingParams", {"n": 2}, True),
        ("GenerateSamplingParams", {"n": 1, "temperature": 0}, True),
        ("GenerateRequest", {"token_ids": [1], "sampling_params": {"n": 3, "temperature": 0}}, False),
        ("CompletionRequest", {"prompt": "a", "n": 2, "temperature": 0}, False),
        ("CompletionRequest", {"prompt": "a", "n": 2, "temperature": 0.7}, True),
        ("ChatCompletionRequest", {"messages": [MSG], "n": 4, "temperature": 0}, False),
        ("ChatCompletionRequest", {"messages": [MSG], "temperature": 0}, True),
    ],
    "top_logprobs_requires_logprobs": [
        ("ChatCompletionRequest", {"messages": [MSG], "top_logprobs": 2}, False),
        ("ChatCompletionRequest", {"messages": [MSG], "top_logprobs": 2, "logprobs": False}, False),
        ("ChatCompletionRequest", {"messages": [MSG], "top_logprobs": 2, "logprobs": True}, True),
        ("ChatCompletionRequest", {"messages": [MSG], "logprobs": True}, True),
        ("BatchChatCompletionRequest", {"messages": [[MSG]], "top_logprobs": 1}, False),
        ("BatchChatCompletionRequest", {"messages": [[MSG]], "top_logprobs": 0}, True),  # 0 asks for nothing (vLLM)
        ("ChatCompletionRequest", {"messages": [MSG], "top_logprobs": None}, True),
        ("BatchChatCompletionRequest", {"messages": [[MSG]], "top_logprobs": 0, "logprobs": True}, True),
    ],
    "logprob_token_ids_requires_logprobs": [
        ("ChatCompletionRequest", {"messages": [MSG], "logprob_token_ids": [1]}, False),
        ("ChatCompletionRequest", {"messages": [MSG], "logprob_token_ids": [1], "logprobs": False}, False),
        ("ChatCompletionRequest", {"messages": [MSG], "logprob_token_ids": [1], "logprobs": True}, True),
        ("BatchChatCompletionRequest", {"messages": [[MSG]], "logprob_token_ids": [1]}, False),
        ("BatchChatCompletionRequest", {"messages": [[MSG]], "logprob_token_ids": [1], "logprobs": True}, True),
        ("CompletionRequest", {"prompt": "a", "logprob_token_ids": [1]}, False),
        ("CompletionRequest", {"prompt": "a", "logprob_token_ids": [1], "logprobs": None}, False),
        ("CompletionRequest", {"prompt": "a", "logprob_token_ids": [1], "logprobs": 0}, True),
        ("GenerateSamplingParams", {"logprob_token_ids": [1]}, False),
        ("GenerateSamplingParams", {"logprob_token_ids": [1], "logprobs": 0}, True),
        ("GenerateRequest", {"token_ids": [1], "sampling_params": {"logprob_token_ids": [7]}}, False),
    ],
    "logprob_token_ids_not_beam_search": [
        ("CompletionRequest", {"prompt": "a", "logprobs": 1, "logprob_token_ids": [1], "use_beam_search": True}, False),
        ("CompletionRequest", {"prompt": "a", "logprobs": 1, "logprob_token_ids": [1], "use_beam_search": False}, True),
        ("CompletionRequest", {"prompt": "a", "use_beam_search": True}, True),
        ("ChatCompletionRequest", {"messages": [MSG], "logprobs": True, "logprob_token_ids": [1], "use_beam_search": True}, False),
        ("ChatCompletionRequest", {"messages": [MSG], "logprobs": True, "logprob_token_ids": [1]}, True),
        ("BatchChatCompletionRequest", {"messages": [[MSG]], "logprobs": True, "logprob_token_ids": [1], "use_beam_search": True}, False),
    ],
    "return_tokens_as_token_ids_requires_logprobs": [
        ("CompletionRequest", {"prompt": "a", "return_tokens_as_token_ids": True}, False),
        ("CompletionRequest", {"prompt": "a", "return_tokens_as_token_ids": True, "logprobs": None}, False),
        ("CompletionRequest", {"prompt": "a", "return_tokens_as_token_ids": True, "logprobs": 0}, True),
        ("CompletionRequest", {"prompt": "a", "return_tokens_as_token_ids": False}, True),
        ("ChatCompletionRequest", {"messages": [MSG], "return_tokens_as_token_ids": True}, False),
        ("ChatCompletionRequest", {"messages": [MSG], "return_tokens_as_token_ids": True, "logprobs": False}, False),
        ("ChatCompletionRequest", {"messages": [MSG], "return_tokens_as_token_ids": True, "logprobs": True}, True),
        ("BatchChatCompletionRequest", {"messages": [[MSG]], "return_tokens_as_token_ids": True}, False),
        ("BatchChatCompletionRequest", {"messages": [[MSG]], "return_tokens_as_token_ids": True, "logprobs": True}, True),
    ],
    "batch_chat_not_streaming": [
        ("BatchChatCompletionRequest", {"messages": [[MSG]], "stream": True}, False),
        ("BatchChatCompletionRequest", {"messages": [[MSG]], "stream": False}, True),
        ("BatchChatCompletionRequest", {"messages": [[MSG]]}, True),
    ],
    "logprob_token_ids_not_echo_without_tokens": [
        ("CompletionRequest", {"prompt": "a", "logprobs": 1, "logprob_token_ids": [1], "echo": True, "max_tokens": 0}, False),
        ("CompletionRequest", {"prompt": "a", "logprobs": 1, "logprob_token_ids": [1], "echo": True, "max_tokens": 1}, True),
        ("CompletionRequest", {"prompt": "a", "logprobs": 1, "logprob_token_ids": [1], "echo": True}, True),
        ("CompletionRequest", {"prompt": "a", "logprobs": 1, "echo": True, "max_tokens": 0}, True),
    ],
    "stop_requires_detokenize": [
        ("GenerateSamplingParams", {"detokenize": False, "stop": ["x"]}, False),
        ("GenerateSamplingParams", {"detokenize": False, "stop": "x"}, False),
        ("GenerateSamplingParams", {"detokenize": False, "stop": []}, True),
        ("GenerateSamplingParams", {"detokenize": False, "stop": None}, True),
        ("GenerateSamplingParams", {"detokenize": True, "stop": "x"}, True),
        ("GenerateSamplingParams", {"stop": ["x"]}, True),
        ("GenerateRequest", {"token_ids": [1], "sampling_params": {"detokenize": False, "stop": ["x"]}}, False),
    ],
    "max_tokens_zero_requires_echo": [
        ("CompletionRequest", {"prompt": "a", "max_tokens": 0}, False),
        ("CompletionRequest", {"prompt": "a", "max_tokens": 0, "echo": False}, False),
        ("CompletionRequest", {"prompt": "a", "max_tokens": 0, "echo": True}, True),
        ("CompletionRequest", {"prompt": "a", "max_tokens": None}, True),
        ("CompletionRequest", {"prompt": "a", "max_tokens": 1}, True),
    ],
}  # fmt: skip


def test_every_rule_has_cases(spec: dict[str, Any]) -> None:
    assert set(RULE_CASES) == rule_ids(spec)


@pytest.mark.parametrize(
    ("rule", "schema", "body", "valid"),
    [(rule, *case) for rule, cases in RULE_CASES.items() for case in cases],
)
def test_rule_accepts_and_rejects(spec: dict[str, Any], rule: str, schema: str, body: dict, valid: bool) -> None:
    assert validator(spec, schema).is_valid(body) is valid, (rule, body)


def test_rule_blocks_are_what_rejects(spec: dict[str, Any]) -> None:
    """Without its allOf, every rejected rule case is valid: the if/then block does the rejecting."""
    stripped = bundle()
    for schema in stripped["components"]["schemas"].values():
        schema.pop("allOf", None)
    for rule, cases in RULE_CASES.items():
        for name, body, _ in cases:
            assert validator(stripped, name).is_valid(body), (rule, body)


# --- bundle and served overlay ------------------------------------------------------------------


def test_bundle_has_no_cross_file_refs_and_is_fresh(spec: dict[str, Any]) -> None:
    refs = re.findall(r'"\$ref": "([^"]*)"', __import__("json").dumps(spec))
    assert refs and all(ref.startswith("#/components/") for ref in refs)
    one = bundle()
    one["paths"].clear()
    assert bundle()["paths"]


def _integer_schemas(node: Any):
    return (sub for sub in walk_schemas(node) if sub.get("type") == "integer")


def test_overlay_limits(served: dict[str, Any]) -> None:
    s = served["components"]["schemas"]
    for name in (*REQUESTS, "GenerateSamplingParams"):
        props = s[name]["properties"]
        if "model" in props:
            assert props["model"]["enum"] == ["tiny", "tiny-alias", None]  # null: not set (the first one)
        if "n" in props:
            assert props["n"]["maximum"] == (1 if name == "BatchChatCompletionRequest" else 8)
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                assert props[field]["maximum"] == 127, (name, field)
        for field in ("token_ids", "prompt", "stop_token_ids", "allowed_token_ids"):
            if field in props:
                ints = list(_integer_schemas(props[field]))
                assert ints and all(i["maximum"] == 511 for i in ints), (name, field)
        if "prompt_logprobs" in props:
            assert props["prompt_logprobs"]["maximum"] == 5
        if "min_tokens" in props:
            assert props["min_tokens"]["maximum"] == 127
    assert s["GenerateRequest"]["properties"]["token_ids"]["maxItems"] == 128
    id_arrays = s["CompletionRequest"]["properties"]["prompt"]["oneOf"]
    assert id_arrays[2]["maxItems"] == 128 and id_arrays[3]["items"]["maxItems"] == 128
    assert id_arrays[3]["maxItems"] == 1024 and "maxItems" not in s["CompletionRequest"]["properties"]["stop_token_ids"]["items"]
    assert s["CompletionRequest"]["properties"]["max_tokens"]["type"] == ["integer", "null"]
    assert s["Extensions"]["properties"] == {"demo": PLUGIN}
    assert s["Extensions"]["additionalProperties"] is False
    runtime = served["x-runtime-rules"]
    ids = [r["id"] for r in runtime]
    assert len(ids) == len(set(ids))
    assert {"min_tokens_le_max_tokens", "prompt_fits_context", "logit_bias_ids_in_vocab", "chat_template_renders"} <= set(ids)
    assert all(set(r) == {"id", "param", "description"} for r in runtime)
    assert runtime == served_table()
    assert not set(ids) & rule_ids(served)


def test_overlay_unsupported_fields(served: dict[str, Any]) -> None:
    s = served["components"]["schemas"]
    # With a wire default: only the default (or null: "not set"); without: absent or null.
    assert s["CompletionRequest"]["properties"]["presence_penalty"]["enum"] == [0.0, None]
    assert s["CompletionRequest"]["properties"]["presence_penalty"]["type"] == ["number", "null"]
    assert s["GenerateSamplingParams"]["properties"]["presence_penalty"]["enum"] == [0.0, None]
    assert s["ChatCompletionRequest"]["properties"]["logprobs"]["enum"] == [False, None]
    assert s["CompletionRequest"]["properties"]["logprobs"]["const"] is None
    assert s["ChatCompletionRequest"]["properties"]["use_beam_search"]["enum"] == [False, None]
    assert s["BatchChatCompletionRequest"]["properties"]["use_beam_search"]["enum"] == [False, None]
    for name in ("CompletionRequest", "ChatCompletionRequest", "BatchChatCompletionRequest", "GenerateSamplingParams"):
        assert s[name]["properties"]["logprob_token_ids"]["type"] == "null", name
        assert s[name]["properties"]["logit_bias"]["type"] == "null", name
    assert s["GenerateSamplingParams"]["properties"]["logprobs"]["type"] == "null"
    assert s["ChatCompletionRequest"]["properties"]["top_logprobs"]["type"] == "null"


def test_served_spec_validates_bodies(served: dict[str, Any]) -> None:
    cases = [
        ("CompletionRequest", {"prompt": [511]}, True),
        ("CompletionRequest", {"prompt": [512]}, False),
        ("CompletionRequest", {"prompt": [[1], [600]]}, False),
        ("CompletionRequest", {"prompt": "a", "model": "tiny-alias"}, True),
        ("CompletionRequest", {"prompt": "a", "model": "gpt-4"}, False),
        ("CompletionRequest", {"prompt": "a", "presence_penalty": 0}, True),
        ("CompletionRequest", {"prompt": "a", "presence_penalty": 0.5}, False),
        ("CompletionRequest", {"prompt": "a", "logit_bias": {}}, False),
        ("CompletionRequest", {"prompt": "a", "logprobs": None}, True),
        ("CompletionRequest", {"prompt": "a", "logprobs": 1}, False),
        ("CompletionRequest", {"prompt": "a", "max_tokens": 127}, True),
        ("CompletionRequest", {"prompt": "a", "max_tokens": 128}, False),
        ("CompletionRequest", {"prompt": "a", "extensions": {"demo": {"level": 1}}}, True),
        ("CompletionRequest", {"prompt": "a", "extensions": {"demo": {"level": -1}}}, False),
        ("CompletionRequest", {"prompt": "a", "extensions": {"other": 1}}, False),
        ("ChatCompletionRequest", {"messages": [MSG], "n": 8, "temperature": 1}, True),
        ("ChatCompletionRequest", {"messages": [MSG], "n": 9}, False),
        ("ChatCompletionRequest", {"messages": [MSG], "stop_token_ids": [512]}, False),
        ("BatchChatCompletionRequest", {"messages": [[MSG]], "n": 2}, False),
        ("GenerateRequest", {"token_ids": [0, 511], "sampling_params": {"prompt_logprobs": 5}}, True),
        ("GenerateRequest", {"token_ids": [0, 511], "sampling_params": {"prompt_logprobs": 6}}, False),
        ("GenerateRequest", {"token_ids": [512]}, False),
        ("GenerateRequest", {"token_ids": [1], "sampling_params": {"allowed_token_ids": [512]}}, False),
    ]
    for name, body, valid in cases:
        assert validator(served, name).is_valid(body) is valid, (name, body)


def test_logit_bias_keys_follow_the_vocabulary() -> None:
    s = served_spec(LIMITS)["components"]["schemas"]
    v = jsonschema_rs.Draft202012Validator(s["CompletionRequest"]["properties"]["logit_bias"])
    assert v.is_valid({"0": 1, "511": -100}) and not v.is_valid({"512": 1}) and not v.is_valid({"01": 1})
    assert s["ChatCompletionRequest"]["properties"]["logprobs"] == bundle()["components"]["schemas"][
        "ChatCompletionRequest"]["properties"]["logprobs"]  # fmt: skip


@pytest.mark.parametrize("hi", [0, 1, 7, 9, 10, 11, 19, 99, 100, 101, 511, 1000, 4095, 49151])
def test_decimal_range_pattern(hi: int) -> None:
    pattern = re.compile(decimal_range_pattern(hi))
    for n in range(0, max(hi * 2, 30) + 20):
        assert bool(pattern.match(str(n))) is (n <= hi), n
    assert not pattern.match("00") and not pattern.match("-1") and not pattern.match("01")


def test_served_limits_edge_cases() -> None:
    with pytest.raises(ValueError):
        ServedLimits(model_names=["m"], vocab_size=0, max_model_len=16, max_request_seqs=1)
    names = request_field_names(bundle())
    assert {"token_ids", "prompt", "messages", "sampling_params", "logprob_token_ids", "extensions"} <= names
    plain = served_spec(ServedLimits(["m"], 10, 16, 1, unsupported={"no_such_field"}))
    assert plain["components"]["schemas"]["CompletionRequest"]["properties"]["n"]["maximum"] == 1
    assert "properties" not in plain["components"]["schemas"]["Extensions"]


def test_schemathesis_loads_the_served_spec(served: dict[str, Any]) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    schema = schemathesis.openapi.from_dict(served)
    labels = []
    for result in schema.get_all_operations():
        operation = result.ok()
        operation.as_strategy()
        labels.append(operation.label)
    assert len(labels) == 27 and "POST /v1/chat/completions/batch" in labels and "POST /v1/responses" in labels
    assert "POST /pause" in labels and "POST /v1/load_lora_adapter" in labels  # the documents' whole spec


# --- codegen ------------------------------------------------------------------------------------


def test_codegen_check_is_clean_on_the_committed_tree(capsys: pytest.CaptureFixture[str]) -> None:
    assert codegen.main(["--check"]) == 0
    assert capsys.readouterr().out == ""


def test_codegen_check_reports_a_stale_copy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = tmp_path / "openapi"
    shutil.copytree(OPENAPI_DIR, docs, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    out = tmp_path / "generated"
    assert codegen.main(["--input-dir", str(docs), "--output-dir", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["common.py", "field_bounds.py", "generate.py", "openai.py"]
    assert codegen.main(["--check", "--input-dir", str(docs), "--output-dir", str(out)]) == 0
    common = docs / "common.yaml"
    common.write_text(common.read_text().replace("total_tokens: {type: integer, minimum: 0}",
                                                 "total_tokens: {type: integer, minimum: 0}\n        cached_tokens: {type: integer}"))  # fmt: skip
    capsys.readouterr()
    assert codegen.main(["--check", "--input-dir", str(docs), "--output-dir", str(out)]) == 1
    diff = capsys.readouterr().out
    assert diff.startswith("--- generated/common.py") and "+    cached_tokens" in diff


def test_the_documents_pause_modes_are_the_engines(spec: dict[str, Any]) -> None:
    """``/pause``'s ``mode`` enum states the engine's modes (the engine decides; the document tells clients)."""
    from gyrfalcon.engine_api.types import PAUSE_MODES

    (mode,) = [p for p in spec["paths"]["/pause"]["post"]["parameters"] if p["name"] == "mode"]
    assert mode["schema"]["enum"] == list(PAUSE_MODES)
