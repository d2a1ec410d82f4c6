"""A table of invalid requests: each is refused with the right status and ``param``, never a 5xx."""

from __future__ import annotations

import pytest

CHAT = "/v1/chat/completions"
BATCH = "/v1/chat/completions/batch"
COMPLETIONS = "/v1/completions"
GENERATE = "/inference/v1/generate"
MSG = [{"role": "user", "content": "hi"}]


def base(path: str) -> dict:
    return {
        CHAT: {"messages": MSG},
        BATCH: {"messages": [MSG]},
        COMPLETIONS: {"prompt": "hi"},
        GENERATE: {"token_ids": [5, 6]},
    }[path]


def with_fields(path: str, **fields) -> tuple[dict, str]:
    """The base body plus ``fields`` (under sampling_params on generate), and the param prefix."""
    body = dict(base(path))
    if path == GENERATE:
        top = {k: fields.pop(k) for k in list(fields) if k in ("stream", "stream_options", "model")}
        body.update(top)
        if fields:
            body["sampling_params"] = fields
        return body, "sampling_params."
    body.update(fields)
    return body, ""


SAMPLING_CASES = [
    # (fields, param without prefix)
    ({"stop": ["x" * 1025]}, "stop"),  # a stop string is at most 1024 characters
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"n": 0}, "n"),
    ({"n": 2, "temperature": 0}, "n"),
    ({"n": 2, "temperature": 0.000001}, "n"),
    ({"seed": 2**63}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"bad_words": [""]}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logprob_token_ids": []}, "logprob_token_ids"),
    ({"logprob_token_ids": [1, 1]}, "logprob_token_ids"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"unknown_field": 1}, "unknown_field"),
]

PATHS = [CHAT, BATCH, COMPLETIONS, GENERATE]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fields,param", SAMPLING_CASES, ids=[str(c[0]) for c in SAMPLING_CASES])
def test_sampling_rules_on_every_endpoint(client, path, fields, param):
    body, prefix = with_fields(path, **fields)
    r = client.simulate_post(path, json=body)
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json["error"]
    assert error["code"] == 400 and error["message"]
    # an item of a list may be named down to its index (``stop.0``)
    assert error["param"] == prefix + param or error["param"].startswith(prefix + param + "."), error


STREAM_CASES = [
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, GENERATE])
@pytest.mark.parametrize("fields,param", STREAM_CASES)
def test_stream_options_need_stream(client, path, fields, param):
    body, _ = with_fields(path, **fields)
    r = client.simulate_post(path, json=body)
    assert r.status_code == 400 and r.json["error"]["param"] == param, r.text


OTHER_CASES = [
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, 400, "prompt.0"),  # the empty item itself
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 1, "logprob_token_ids": [1]}, 400, "logprob_token_ids"),
    (COMPLETIONS, {"prompt": "x", "logprob_token_ids": [1]}, 400, "logprob_token_ids"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 1, "logprob_token_ids": [1], "use_beam_search": True}, 400, "logprob_token_ids"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),  # above --max-logprobs (20)
    (COMPLETIONS, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),  # whole vocabulary: not on this server
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 1, "logprob_token_ids": list(range(129))}, 400, "logprob_token_ids"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 1, "logprob_token_ids": [10**6]}, 400, "logprob_token_ids"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 1, "logprob_token_ids": [512]}, 400, "logprob_token_ids"),  # vocab is 512
    (COMPLETIONS, {"prompt": "x", "echo": True, "max_tokens": 0, "logprob_token_ids": [1]}, 400, "logprob_token_ids"),
    (COMPLETIONS, {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    (COMPLETIONS, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    (COMPLETIONS, {"prompt": [10**6]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "x", "model": "nope"}, 404, "model"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "x", "return_tokens_as_token_ids": True}, 400, "return_tokens_as_token_ids"),
    (CHAT, {"messages": MSG, "return_tokens_as_token_ids": True}, 400, "return_tokens_as_token_ids"),
    (BATCH, {"messages": [MSG], "return_tokens_as_token_ids": True, "logprobs": False}, 400, "return_tokens_as_token_ids"),
    (GENERATE, {"token_ids": [5], "sampling_params": {"detokenize": False, "stop": "x"}}, 400, "sampling_params.stop"),
    (GENERATE, {"token_ids": [5], "priority": 1}, 400, "priority"),  # fcfs server: only priority 0
    (COMPLETIONS, {"prompt": "a", "priority": -3}, 400, "priority"),
    (COMPLETIONS, {"prompt": [[5]] * 129, "n": 8, "temperature": 1}, 400, "n"),  # 1032 sequences > 1024
    (BATCH, {"messages": [MSG] * 1025}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.tool_call_id"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, 400, "messages.0.tool_call_id"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "reasoning_content": "r"}]}, 400, "messages.0.reasoning_content"),
    (CHAT, {"messages": [MSG[0], {"role": "tool", "content": "x", "tool_calls": []}]}, 400, "messages.1.tool_calls"),
    (CHAT, {"messages": [MSG[0], {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{oops"}}]}]}, 400, "messages.1.tool_calls.0.function.arguments"),
    (BATCH, {"messages": [[MSG[0]], [MSG[0], {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
        "function": {"name": "f", "arguments": "{}"}}]}]]}, 400, "messages.1.1.tool_calls"),  # the template ignores calls
    (CHAT, {"messages": MSG, "tools": []}, 400, "tools"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     400, "tools.0.function.parameters"),  # auto (the default): refused as OpenAI does, not only when a call is forced
    (CHAT, {"messages": MSG, "tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f"}},
     {"type": "function", "function": {"name": "g", "parameters": {"properties": []}}}]}, 400, "tools.1.function.parameters"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": False, "logprob_token_ids": [3]}, 400, "logprob_token_ids"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprob_token_ids": [3]}, 400, "logprob_token_ids"),
    (CHAT, {"messages": MSG, "logprobs": True, "logprob_token_ids": [3], "use_beam_search": True}, 400, "logprob_token_ids"),
    (CHAT, {"messages": MSG, "logprobs": True, "logprob_token_ids": [3, 3]}, 400, "logprob_token_ids"),
    (CHAT, {"messages": MSG, "logprobs": True, "logprob_token_ids": [512]}, 400, "logprob_token_ids"),
    (CHAT, {"messages": MSG, "logprobs": True, "logprob_token_ids": list(range(129))}, 400, "logprob_token_ids"),
    (BATCH, {"messages": [MSG], "logprob_token_ids": [3]}, 400, "logprob_token_ids"),
    (BATCH, {"messages": [MSG], "logprobs": True, "logprob_token_ids": []}, 400, "logprob_token_ids"),
    (BATCH, {"messages": [MSG], "top_logprobs": 1}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (BATCH, {"messages": [MSG], "n": 2}, 400, "n"),
    (BATCH, {"messages": [MSG], "stream": True}, 400, "stream"),
    (BATCH, {"messages": [[]]}, 400, "messages.0"),
    (GENERATE, {"token_ids": []}, 400, "token_ids"),
    (GENERATE, {"token_ids": [-1]}, 400, "token_ids.0"),
    (GENERATE, {"token_ids": [10**6]}, 400, "token_ids"),
    (GENERATE, {"token_ids": [5], "sampling_params": {"max_tokens": 0}}, 400, "sampling_params.max_tokens"),
    (GENERATE, {"token_ids": [5], "sampling_params": {"logprob_token_ids": [3]}}, 400, "sampling_params.logprob_token_ids"),
    (GENERATE, {"token_ids": [5], "sampling_params": {"logprobs": 21}}, 400, "sampling_params.logprobs"),
    (GENERATE, {"token_ids": [5], "sampling_params": {"logprobs": 1, "logprob_token_ids": [512]}}, 400,
     "sampling_params.logprob_token_ids"),
    (GENERATE, {"token_ids": [5], "stream": True, "sampling_params": {"prompt_logprobs": 1}}, 400,
     "sampling_params.prompt_logprobs"),
]


@pytest.mark.parametrize("path,body,status,param", OTHER_CASES, ids=[f"{c[0]}:{c[1]}" for c in OTHER_CASES])
def test_endpoint_rules(client, path, body, status, param):
    r = client.simulate_post(path, json=body)
    assert r.status_code == status, (r.status_code, r.text)
    assert r.json["error"]["param"] == param, r.json
    assert r.json["error"]["code"] == status


@pytest.mark.parametrize("prompt,param,says", [
    ([-1], "prompt.0", "greater than or equal to 0"),
    ([[1], [-3]], "prompt.1.0", "greater than or equal to 0"),
    (5, "prompt", "valid string"),
])
def test_a_prompt_error_names_the_item_and_its_bound(client, prompt, param, says):
    """Not "Input should be a valid string" for a negative id: the union member the client meant speaks."""
    r = client.simulate_post(COMPLETIONS, json={"prompt": prompt})
    assert r.status_code == 400 and r.json["error"]["param"] == param and says in r.json["error"]["message"], r.text


def test_prompt_too_long_names_the_prompt(client, tiny_engine):
    context = tiny_engine.info().max_model_len
    r = client.simulate_post(GENERATE, json={"token_ids": [5] * (context + 1)})
    assert r.status_code == 400 and r.json["error"]["param"] == "token_ids"
    r = client.simulate_post(GENERATE, json={"token_ids": [5] * 4, "sampling_params": {"max_tokens": context}})
    assert r.status_code == 400 and r.json["error"]["param"] == "sampling_params.max_tokens"


def test_http_level_errors_share_the_envelope(client):
    r = client.simulate_get("/nope")
    assert r.status_code == 404 and r.json["error"]["code"] == 404
    r = client.simulate_get(COMPLETIONS)
    assert r.status_code == 405 and r.json["error"]["code"] == 405
    r = client.simulate_post(COMPLETIONS, body=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json["error"]["code"] == 415
    r = client.simulate_post(COMPLETIONS, body=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json["error"]["code"] == 400
    r = client.simulate_post(COMPLETIONS, json={"prompt": "x" * (70 * 1024)})
    assert r.status_code == 413 and r.json["error"]["code"] == 413
    r = client.simulate_post(COMPLETIONS, body=b"[1, 2]", headers={"Content-Type": "application/json"})
    assert r.status_code == 400


def test_whole_floats_are_integers_but_strings_are_not(client):
    r = client.simulate_post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2.0, "temperature": 1, "seed": 1})
    assert r.status_code == 200, r.text
    r = client.simulate_post(COMPLETIONS, json={"prompt": "x", "max_tokens": "2"})
    assert r.status_code == 400 and r.json["error"]["param"] == "max_tokens"
    r = client.simulate_post(COMPLETIONS, json={"prompt": "x", "max_tokens": True})
    assert r.status_code == 400 and r.json["error"]["param"] == "max_tokens"


def test_wire_param_mapping():
    from gyrfalcon.protocol.rules import wire_param

    assert wire_param("generate", "bad_words.0") == "sampling_params.bad_words.0"
    assert wire_param("generate", "prompt") == "token_ids"
    assert wire_param("chat", "prompt") == "messages"
    assert wire_param("completions", "max_tokens") == "max_tokens"
    assert wire_param("generate", "request_id") == "request_id"
    assert wire_param("chat", None) is None


def test_a_field_is_named_where_the_client_wrote_it():
    """One mapping names every engine-side param: a dotted top-level field stays at the top level on
    generate, and a constraint is named after the field it came from (a text response_format is none)."""
    from gyrfalcon.protocol.rules import RequestFields, wire_param
    from gyrfalcon.protocol.requests import wire_names

    assert wire_param("generate", "extensions.demo.x") == "extensions.demo.x"
    assert wire_param("generate", "top_k") == "sampling_params.top_k"
    assert wire_param("generate", "sampling_params.top_k") == "sampling_params.top_k"
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}
    chat = RequestFields.from_body("chat", {"messages": [], "response_format": schema})
    assert wire_names(chat)("structured_outputs.json") == "response_format.json_schema.schema"
    assert wire_names(chat)("structured_outputs") == "response_format"
    text = RequestFields.from_body("chat", {"messages": [], "response_format": {"type": "text"}})
    assert wire_names(text)("structured_outputs.regex") == "structured_outputs.regex"
    generate = RequestFields.from_body("generate", {"token_ids": [1], "sampling_params": {"top_k": 2}})
    assert wire_names(generate)("top_k") == "sampling_params.top_k"
    assert wire_names(generate)("prompt") == "token_ids"


def test_deep_nesting_is_a_400_not_a_500(client):
    """Nesting below orjson's own limit (1024) used to overflow the Python walk: a 500 and a long
    traceback per request."""
    deep: object = 1
    for _ in range(600):
        deep = {"k": deep}
    r = client.simulate_post(CHAT, json={"messages": MSG, "chat_template_kwargs": {"x": deep}})
    assert r.status_code == 400, r.text
    assert r.json["error"]["param"].startswith("chat_template_kwargs.x") and "levels deep" in r.text
    r = client.simulate_post(COMPLETIONS, body=b'{"prompt": ' + b"[" * 900 + b"]" * 900 + b"}",
                             headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text


def test_many_bad_logit_bias_keys_name_a_few_and_count_the_rest(client):
    """As many keys that are not token ids as an object may hold here (a key per token of the
    vocabulary): a 400 naming the first, the next few, and how many more. At 20,000 keys the message
    was 409 KB and finding them a quadratic search, 1.6 s of CPU per request: six such requests at
    once held every thread of a default server's worker. The keys are now checked against the
    documents' pattern before the generated model sees them (pydantic's 20,000 error objects cost
    ~100 ms a body, mostly holding the interpreter's lock); the refusal reads as pydantic's did."""
    keys = client.simulate_get("/openapi.json").json["x-limits"]["body"]["max_object_keys"]
    r = client.simulate_post(CHAT, json={"messages": MSG, "logit_bias": {f"k{i}": 1 for i in range(keys)}})
    assert r.status_code == 400, r.text
    error = r.json["error"]
    assert error["param"] == "logit_bias.k0"
    assert error["message"].startswith("Invalid value for 'logit_bias.k0': String should match pattern")
    assert "'logit_bias.k1'" in error["message"] and "'logit_bias.k8'" in error["message"]
    assert "'logit_bias.k9'" not in error["message"] and f"and {keys - 9:,} more" in error["message"]
    assert len(error["message"]) < 1000


def test_a_refused_body_goes_with_its_request_not_with_a_garbage_collection(client):
    """A refusal's traceback held its frames, and their locals the parsed body and its validation
    errors, in a reference cycle with the error handlers' frames: each refused body of bad
    logit_bias keys left its thousands of error dicts for the collector, whose full passes held
    the interpreter's lock 40 to 110 ms in a worker (an abuse campaign's other client waited)."""
    import gc

    body = {"messages": MSG, "logit_bias": {f"k{i}": 1 for i in range(300)}}
    client.simulate_post(CHAT, json=body)  # anything built once, built
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        assert client.simulate_post(CHAT, json=body).status_code == 400
        gc.collect()
        dicts = sum(type(o) is dict for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert dicts < 100, f"{dicts} dicts in reference cycles after one refusal of 300 bad keys"


def test_an_object_larger_than_any_field_takes_is_refused_before_it_is_walked(client):
    """The served spec states the most keys an object may hold (the vocabulary's size: a
    ``logit_bias`` entry per token); one key more is a 400 naming the object, wherever it is."""
    limits = client.simulate_get("/openapi.json").json["x-limits"]["body"]
    keys = limits["max_object_keys"]
    assert limits["max_array_items"] >= 1 and limits["max_depth"] >= 8
    too_many = {str(i): 1 for i in range(keys + 1)}
    r = client.simulate_post(CHAT, json={"messages": MSG, "logit_bias": too_many})
    assert r.status_code == 400 and r.json["error"]["param"] == "logit_bias", r.text
    assert f"holds {keys + 1:,} keys" in r.json["error"]["message"]
    r = client.simulate_post(CHAT, json={"messages": [{"role": "user", "content": "hi", "extra": too_many}]})
    assert r.status_code == 400 and r.json["error"]["param"] == "messages.0.extra", r.text
    r = client.simulate_post(CHAT, json={"messages": MSG, "logit_bias": {"1": 1}})
    assert r.status_code == 200, r.text


def test_a_text_longer_than_the_context_can_hold_is_refused_before_it_is_tokenized(client, tiny_engine, monkeypatch):
    """A prompt (or the messages' text) of more characters than the context times the longest
    token's: a 400 naming it, and the tokenizer and the chat template never see it."""
    bound = tiny_engine.info().max_model_len * tiny_engine.longest_token_chars()
    assert client.simulate_get("/openapi.json").json["x-limits"]["max_text_chars"] == bound
    seen = []
    monkeypatch.setattr(tiny_engine, "tokenize", lambda text, **kw: seen.append(len(text)) or [1])
    text = "ab" * (bound // 2 + 1)
    for path, body, param in (
        (COMPLETIONS, {"prompt": text, "max_tokens": 1}, "prompt"),
        (COMPLETIONS, {"prompt": ["x", text], "max_tokens": 1}, "prompt.1"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}, "messages.0.content.0.text"),
        (CHAT, {"messages": [{"role": "user", "content": text[: bound // 2 + 1]}] * 2}, "messages"),  # together
        ("/tokenize", {"prompt": text}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": text}]}, "messages.0.content"),
    ):
        r = client.simulate_post(path, json=body)
        assert r.status_code == 400 and r.json["error"]["param"] == param, (path, r.text)
        assert "more than the model's context" in r.json["error"]["message"]
    assert all(length < bound for length in seen)  # only the short prompt "x" was tokenized


def test_a_compressed_body_is_a_415(client):
    import gzip

    body = gzip.compress(b'{"prompt": "x", "max_tokens": 1}')
    r = client.simulate_post(COMPLETIONS, body=body, headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 415 and "gzip" in r.json["error"]["message"]
    r = client.simulate_post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1}, headers={"Content-Encoding": "identity"})
    assert r.status_code == 200
