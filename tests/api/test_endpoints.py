"""Every endpoint on the real tiny-model engine: shapes, n > 1, streaming, stops, echo, usage."""

from __future__ import annotations

import pytest

from tests.helpers import chat_delta_text, sse_events, stream_by_choice

SAMPLED = {"temperature": 1.0, "seed": 1234, "ignore_eos": True}


def post(client, path, body, **kw):
    return client.simulate_post(path, json=body, **kw)


def test_health_version_models(client):
    assert client.simulate_get("/health").json == {"status": "ok", "decode_path": "eager (--enforce-eager)",
                                                   "weight_version": "default"}  # fmt: skip
    assert "version" in client.simulate_get("/version").json
    models = client.simulate_get("/v1/models").json
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] > 0


def test_completion_shape_and_usage(client):
    r = post(client, "/v1/completions", {"model": "tiny", "prompt": "hello world", "max_tokens": 5, **SAMPLED})
    assert r.status_code == 200, r.text
    body = r.json
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5


@pytest.mark.parametrize("n", [2, 4, 8])
def test_completion_n_returns_all_choices(client, n):
    r = post(client, "/v1/completions", {"prompt": "abc", "max_tokens": 4, "n": n, **SAMPLED})
    assert r.status_code == 200, r.text
    choices = r.json["choices"]
    assert [c["index"] for c in choices] == list(range(n))
    assert all(c["finish_reason"] == "length" for c in choices)
    assert r.json["usage"]["completion_tokens"] == 4 * n


@pytest.mark.parametrize("path,body,text_of", [
    ("/v1/completions", {"prompt": "the cat", "max_tokens": 6}, lambda c: c.get("text", "")),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}, chat_delta_text),
])
@pytest.mark.parametrize("n", [1, 3])
def test_streaming_n_matches_non_streaming(client, path, body, text_of, n):
    body = {**body, **SAMPLED, "n": n}
    final = post(client, path, body).json
    r = post(client, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
    events = sse_events(r.text)
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == final["usage"]
    joined = stream_by_choice(events[:-2] + ["[DONE]"], text_of)
    assert sorted(joined) == list(range(n))
    for choice in final["choices"]:
        got = joined[choice["index"]]
        assert got["finishes"] == [choice["finish_reason"]], got
        assert got["after_finish"] == 0
        expected = choice["text"] if "text" in choice else choice["message"]["content"]
        assert got["text"] == expected


def test_chat_shape_roles_and_developer(client):
    body = {
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]},
        ],
        "max_completion_tokens": 3, "max_tokens": 50, **SAMPLED,
    }
    r = post(client, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    (choice,) = r.json["choices"]
    assert choice["message"]["role"] == "assistant"
    assert r.json["usage"]["completion_tokens"] == 3  # max_completion_tokens wins over max_tokens
    assert r.json["object"] == "chat.completion"


def test_chat_stream_opens_with_roles(client):
    r = post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 2, "stream": True, **SAMPLED})
    events = sse_events(r.text)
    opening = events[:2]  # a role chunk per choice, one choice per chunk, before any content
    assert all(e["object"] == "chat.completion.chunk" and len(e["choices"]) == 1 for e in opening)
    assert [e["choices"][0]["index"] for e in opening] == [0, 1]
    assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in opening)
    finishes = [e["choices"][0]["index"] for e in events[2:-1] if e["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]  # a finish chunk per choice


def test_chat_default_max_tokens_is_up_to_context(client, tiny_engine):
    r = post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **SAMPLED})
    assert r.status_code == 200, r.text
    usage = r.json["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == tiny_engine.info().max_model_len


def test_batch_chat_one_choice_per_conversation(client):
    convs = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "bb"}], [{"role": "user", "content": "ccc"}]]
    r = post(client, "/v1/chat/completions/batch", {"messages": convs, "max_tokens": 3, **SAMPLED})
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json["choices"]] == [0, 1, 2]
    assert r.json["usage"]["completion_tokens"] == 9
    singles = [post(client, "/v1/chat/completions", {"messages": c, "max_tokens": 3, **SAMPLED}).json for c in convs]
    assert r.json["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert [c["message"]["content"] for c in r.json["choices"]] == [s["choices"][0]["message"]["content"] for s in singles]


def test_generate_tokens_in_tokens_out(client):
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "n": 2, **SAMPLED}, "request_id": "abc"}
    r = post(client, "/inference/v1/generate", body)
    assert r.status_code == 200, r.text
    assert r.json["request_id"] == "generate-tokens-abc"
    assert [c["index"] for c in r.json["choices"]] == [0, 1]
    assert all(len(c["token_ids"]) == 4 for c in r.json["choices"])
    assert r.json["usage"]["prompt_tokens"] == 3
    r = post(client, "/inference/v1/generate", body, headers={"X-Request-Id": "hdr"})
    assert r.json["request_id"] == "generate-tokens-hdr"  # the header wins over the body


def test_generate_stream_tokens_join(client):
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 5, "n": 2, **SAMPLED}}
    final = post(client, "/inference/v1/generate", body).json
    events = sse_events(post(client, "/inference/v1/generate", {**body, "stream": True}).text)
    joined = stream_by_choice(events)
    for choice in final["choices"]:
        assert joined[choice["index"]]["token_ids"] == choice["token_ids"]
        assert joined[choice["index"]]["finishes"] == [choice["finish_reason"]]


def test_several_prompts_index_is_prompt_times_n_plus_j(client):
    prompts = [[5, 6], [7, 8, 9]]
    r = post(client, "/v1/completions", {"prompt": prompts, "n": 2, "max_tokens": 2, **SAMPLED, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choices = r.json["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in choices] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert r.json["usage"]["prompt_tokens"] == 5 and r.json["usage"]["completion_tokens"] == 8


def test_echo_of_token_ids_returns_text(client, tiny_engine):
    ids = tiny_engine.tokenize("hello there")
    r = post(client, "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 0})
    assert r.status_code == 200, r.text
    assert r.json["choices"][0]["text"] == tiny_engine.detokenize(ids)
    assert r.json["usage"]["completion_tokens"] == 0
    r = post(client, "/v1/completions", {"prompt": "hello there", "echo": True, "max_tokens": 2, **SAMPLED})
    assert r.json["choices"][0]["text"].startswith("hello there")


def test_stop_token_ids_end_the_choice(client):
    greedy = post(client, "/inference/v1/generate", {"token_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_tokens": 6, "ignore_eos": True}}).json
    tokens = greedy["choices"][0]["token_ids"]
    stop_id = tokens[2]
    first = tokens.index(stop_id)
    r = post(client, "/inference/v1/generate", {"token_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "stop_token_ids": [stop_id]}}).json
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert choice["token_ids"] == tokens[: first + 1]


def test_stop_string_cuts_text(client):
    base = {"prompt": "once upon", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = post(client, "/v1/completions", base).json["choices"][0]["text"]
    stop = text[3:5]
    if not stop.strip():
        pytest.skip("greedy text too uniform for a stop string")
    cut = post(client, "/v1/completions", {**base, "stop": [stop]}).json["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["text"] == text[: text.index(stop)]
    kept = post(client, "/v1/completions", {**base, "stop": stop, "include_stop_str_in_output": True}).json["choices"][0]
    assert kept["text"] == text[: text.index(stop) + len(stop)]


def test_seeded_sampling_is_reproducible(client):
    body = {"prompt": "abc", "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    a = post(client, "/v1/completions", body).json["choices"]
    b = post(client, "/v1/completions", body).json["choices"]
    assert [c["text"] for c in a] == [c["text"] for c in b]


def test_openapi_json_is_the_served_spec(client):
    spec = client.simulate_get("/openapi.json").json
    assert spec["openapi"].startswith("3.1")
    assert "/v1/chat/completions" in spec["paths"]


def test_tokenize_and_detokenize(client, tiny_engine):
    r = client.simulate_post("/tokenize", json={"prompt": "hello there"})
    assert r.status_code == 200, r.text
    assert r.json["tokens"] == tiny_engine.tokenize("hello there") and r.json["count"] == len(r.json["tokens"])
    assert r.json["max_model_len"] == tiny_engine.info().max_model_len
    back = client.simulate_post("/detokenize", json={"tokens": r.json["tokens"]})
    assert back.json == {"prompt": "hello there"}
    msgs = [{"role": "user", "content": "hi"}]
    chat = client.simulate_post("/tokenize", json={"messages": msgs, "model": "tiny"}).json
    completion = post(client, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1}).json
    assert chat["count"] == completion["usage"]["prompt_tokens"]  # what chat completions count
    assert client.simulate_post("/detokenize", json={"tokens": [10**6]}).json["error"]["param"] == "tokens"
    assert client.simulate_post("/tokenize", json={"prompt": "x", "model": "nope"}).status_code == 404
    assert client.simulate_post("/tokenize", json={}).json["error"]["param"] == "prompt"


def test_user_is_recorded_in_the_access_log(client, caplog):
    with caplog.at_level("INFO", logger="gyrfalcon.access"):
        r = post(client, "/v1/completions", {"prompt": "x", "max_tokens": 1, "user": "user-42"})
    assert r.status_code == 200
    assert any("user='user-42'" in rec.getMessage() for rec in caplog.records)


def test_a_request_id_cannot_forge_an_access_log_line(client, caplog):
    """A client's request id with a line break and a terminal escape is logged escaped."""
    with caplog.at_level("INFO", logger="gyrfalcon.access"):
        r = post(client, "/v1/completions", {"prompt": "x", "max_tokens": 1, "request_id": "a\nINFO forged\x1b[2J"})
    assert r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "gyrfalcon.access"]
    assert lines and all("\n" not in line and "\x1b" not in line for line in lines)
    assert any("a\\x0aINFO forged\\x1b[2J" in line for line in lines)


def test_stream_chunks_carry_every_field_the_spec_requires(client):
    """usage: null on every chunk but the usage chunk; prompt_token_ids once per choice."""
    body = {"prompt": [[5, 6], [7]], "n": 2, "max_tokens": 3, "stream": True, "return_token_ids": True, **SAMPLED}
    events = sse_events(post(client, "/v1/completions", body).text)[:-1]
    assert all("usage" in e and e["usage"] is None for e in events)
    firsts = {}
    for e in events:
        for c in e["choices"]:
            assert "prompt_token_ids" in c and "prompt_logprobs" in c  # vLLM's fields, null when unused
            if c["prompt_token_ids"] is not None:
                assert c["index"] not in firsts
                firsts[c["index"]] = c["prompt_token_ids"]
    assert firsts == {0: [5, 6], 1: [5, 6], 2: [7], 3: [7]}
    chat = sse_events(post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}).text)[:-1]
    assert all(e["usage"] is None for e in chat)
    assert all(c["stop_reason"] is None for c in chat[0]["choices"])


def test_completions_logprob_ids_sharing_a_text_all_appear(client, tiny_engine):
    """Ids that decode to the same text (partial UTF-8 bytes) must not collapse into one key."""
    vocab = tiny_engine.info().vocab_size
    by_text: dict[str, list[int]] = {}
    for token_id, text in enumerate(tiny_engine.token_strings(list(range(vocab)))):
        by_text.setdefault(text, []).append(token_id)
    shared = next(ids for ids in by_text.values() if len(ids) >= 3)[:3]
    body = {"prompt": "hello", "max_tokens": 2, "logprobs": 1, "logprob_token_ids": shared, "return_token_ids": True, **SAMPLED}
    choice = post(client, "/v1/completions", body).json["choices"][0]
    for sampled, top in zip(choice["token_ids"], choice["logprobs"]["top_logprobs"]):
        assert len(top) == len(set(shared) | {sampled})  # one entry per listed id: none collapsed
        assert sum(k.startswith("token_id:") for k in top) >= len(shared) - 1


@pytest.mark.parametrize("path,base", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
def test_null_means_not_set(client, path, base):
    """OpenAI clients send null for unset fields: same answer as leaving them out."""
    nulls = {"temperature": None, "top_p": None, "seed": None, "stop": None, "presence_penalty": None,
             "frequency_penalty": None, "logit_bias": None, "user": None}
    if path == "/v1/completions":
        nulls["max_tokens"] = None
    else:
        nulls.update(max_tokens=None, max_completion_tokens=None)
    r = post(client, path, {**base, **nulls, "n": 2, "seed": 3, "temperature": 0.5, "max_tokens": 3})
    assert r.status_code == 200, r.text
    r = post(client, path, {**base, **nulls})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("temperature", [2.5, 1e4, 1.7976931348623157e308])
def test_temperature_has_no_upper_bound(client, temperature):
    """vLLM's rule: any temperature >= 0; a huge one samples (near) uniformly, never NaN or a 500."""
    r = post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": temperature, "seed": 3,
                                         "ignore_eos": True, "logprobs": 1})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json["usage"]["completion_tokens"] == 4


def test_vllm_fields_are_always_serialised(client):
    """SDK code reads ``choice.prompt_logprobs``, ``choice.token_ids``, ``message.reasoning_content``:
    present (null or empty) whether asked for or not."""
    completion = post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).json["choices"][0]
    assert {k: completion[k] for k in ("token_ids", "prompt_token_ids", "prompt_logprobs")} == dict.fromkeys(
        ("token_ids", "prompt_token_ids", "prompt_logprobs"))
    chat = post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).json
    assert chat["prompt_logprobs"] is None and chat["prompt_token_ids"] is None
    choice = chat["choices"][0]
    assert choice["token_ids"] is None and choice["message"]["reasoning_content"] is None
    assert choice["message"]["tool_calls"] == []


def test_chat_return_token_ids(client, tiny_engine):
    messages = [{"role": "user", "content": "hello"}]
    body = {"messages": messages, "max_tokens": 3, "return_token_ids": True, **SAMPLED}
    r = post(client, "/v1/chat/completions", body).json
    prompt = client.simulate_post("/tokenize", json={"messages": messages}).json["tokens"]
    assert r["prompt_token_ids"] == prompt and r["usage"]["prompt_tokens"] == len(prompt)
    (choice,) = r["choices"]
    assert len(choice["token_ids"]) == 3
    assert tiny_engine.detokenize(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]
    events = sse_events(post(client, "/v1/chat/completions", {**body, "stream": True}).text)[:-1]
    assert events[0]["prompt_token_ids"] == prompt
    assert [t for e in events for t in e["choices"][0].get("token_ids") or []] == choice["token_ids"]
    batch = post(client, "/v1/chat/completions/batch", {"messages": [messages, messages], "max_tokens": 2,
                                                         "return_token_ids": True, **SAMPLED}).json  # fmt: skip
    assert [c["prompt_token_ids"] for c in batch["choices"]] == [prompt, prompt]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": ["a b", "c"], "n": 2, "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2, "max_tokens": 3}),
])
def test_continuous_usage_stats(client, path, body):
    """Every chunk carries its prompt's tokens and its choice's tokens so far (vLLM)."""
    body = {**body, **SAMPLED, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(post(client, path, body).text)[:-1]
    final = events[-1]
    choices = 4 if path == "/v1/completions" else 2  # prompts x n
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 3 * choices
    seen: dict[int, int] = {}
    for event in events[:-1]:
        usage, (choice,) = event["usage"], event["choices"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] >= seen.get(choice["index"], 0)
        seen[choice["index"]] = usage["completion_tokens"]
    assert sorted(seen) == list(range(choices)) and set(seen.values()) == {3}


def test_tokenize_token_strs_and_model_cards(client, tiny_engine):
    r = client.simulate_post("/tokenize", json={"prompt": "hello there", "return_token_strs": True}).json
    assert r["token_strs"] == tiny_engine.tokenizer.convert_ids_to_tokens(r["tokens"])
    assert client.simulate_post("/tokenize", json={"prompt": "hello"}).json["token_strs"] is None
    chat = client.simulate_post("/tokenize", json={"messages": [{"role": "user", "content": "x"}], "return_token_strs": True})
    assert len(chat.json["token_strs"]) == chat.json["count"]
    card = client.simulate_get("/v1/models").json["data"][0]
    assert card["root"] == "tiny" and card["parent"] is None and card["permission"][0]["object"] == "model_permission"


def test_openai_fields_that_change_nothing_are_accepted_and_recorded(client, caplog):
    """metadata, store: false, service_tier, … as the OpenAI SDK sends them: accepted, logged, no effect."""
    messages = [{"role": "user", "content": "x"}]
    fixed = {"messages": messages, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    extra = {"metadata": {"team": "eval"}, "store": False, "service_tier": "auto", "modalities": ["text"],
             "response_format": {"type": "text"}, "parallel_tool_calls": True, "prompt_cache_key": "k",
             "safety_identifier": "s1"}  # fmt: skip
    plain = post(client, "/v1/chat/completions", fixed).json
    with caplog.at_level("INFO", logger="gyrfalcon.access"):
        r = post(client, "/v1/chat/completions", {**fixed, **extra})
    assert r.status_code == 200, r.text
    assert r.json["choices"][0]["message"] == plain["choices"][0]["message"]
    assert "metadata={'team': 'eval'}" in caplog.text and "service_tier='auto'" in caplog.text
    assert post(client, "/v1/chat/completions/batch", {**fixed, "messages": [messages], **extra}).status_code == 200


@pytest.mark.parametrize("extra,param", [
    ({"store": True}, "store"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),  # a schema that does not compile
    ({"modalities": ["audio"]}, "modalities.0"),
    ({"service_tier": "fastest"}, "service_tier"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),  # maxProperties, stated in the spec
    ({"chat_template_kwargs": {f"k{i}": 1 for i in range(33)}}, "chat_template_kwargs"),
])
def test_openai_fields_that_would_change_the_output_are_refused(client, extra, param):
    r = post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **extra})
    assert r.status_code == 400 and r.json["error"]["param"] == param, r.text


def test_chat_template_options(client, tiny_engine):
    """continue_final_message, add_special_tokens and chat_template_kwargs reach the template."""
    opened = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    r = post(client, "/v1/chat/completions", {"messages": opened, "continue_final_message": True,
                                              "add_generation_prompt": False, "max_tokens": 2, "return_token_ids": True})
    assert r.status_code == 200, r.text
    rendered = tiny_engine.detokenize(r.json["prompt_token_ids"])
    assert rendered.endswith("The answer is")  # the last message left open
    refused = post(client, "/v1/chat/completions", {"messages": opened, "continue_final_message": True})
    assert refused.status_code == 400 and refused.json["error"]["param"] == "continue_final_message"
    kwargs = post(client, "/v1/chat/completions", {"messages": opened[:1], "max_tokens": 1,
                                                   "chat_template_kwargs": {"enable_thinking": False}})
    assert kwargs.status_code == 200, kwargs.text
    reserved = post(client, "/v1/chat/completions", {"messages": opened[:1], "chat_template_kwargs": {"tokenize": True}})
    assert reserved.status_code == 400 and reserved.json["error"]["param"] == "chat_template_kwargs"
    plain = post(client, "/v1/chat/completions", {"messages": opened[:1], "max_tokens": 1, "return_token_ids": True}).json
    special = post(client, "/v1/chat/completions", {"messages": opened[:1], "max_tokens": 1, "return_token_ids": True,
                                                    "add_special_tokens": True}).json  # fmt: skip
    text = tiny_engine.detokenize(plain["prompt_token_ids"])
    assert plain["prompt_token_ids"] == tiny_engine.tokenize(text, add_special_tokens=False)
    assert special["prompt_token_ids"] == tiny_engine.tokenize(text, add_special_tokens=True)


def test_generate_takes_stop_as_one_string_or_a_list(client, tiny_engine):
    """vLLM's SamplingParams.stop is str | list[str]; token-in/token-out clients send either."""
    body = {"token_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_tokens": 12, "ignore_eos": True}}
    plain = post(client, "/inference/v1/generate", body).json["choices"][0]["token_ids"]
    stop = tiny_engine.detokenize(plain[3:5])
    assert stop.strip()
    outs = []
    for value in (stop, [stop]):
        r = post(client, "/inference/v1/generate", {**body, "sampling_params": {**body["sampling_params"], "stop": value}})
        assert r.status_code == 200, r.text
        outs.append(r.json["choices"][0])
    assert outs[0] == outs[1] and outs[0]["finish_reason"] == "stop" and outs[0]["stop_reason"] == stop


def test_generate_text_is_cut_at_the_stop_string_or_keeps_it_when_asked(client, tiny_engine):
    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    body = {"token_ids": [5, 6, 7], "sampling_params": params}
    plain = post(client, "/inference/v1/generate", body).json["choices"][0]
    assert plain["text"] == tiny_engine.detokenize(plain["token_ids"], skip_special_tokens=True)
    stop = tiny_engine.detokenize(plain["token_ids"][3:5])
    start = plain["text"].index(stop)
    for keep, expected in ((False, plain["text"][:start]), (True, plain["text"][: start + len(stop)])):
        sent = {**body, "sampling_params": {**params, "stop": stop, "include_stop_str_in_output": keep}}
        choice = post(client, "/inference/v1/generate", sent).json["choices"][0]
        assert choice["text"] == expected and choice["stop_reason"] == stop
        streamed = stream_by_choice(sse_events(post(client, "/inference/v1/generate", {**sent, "stream": True}).text))
        assert streamed[0]["text"] == expected


def test_head_answers_like_get_without_a_body(client):
    for path in ("/health", "/v1/models", "/version", "/openapi.json", "/metrics"):
        get, head = client.simulate_get(path), client.simulate_head(path)
        assert head.status_code == get.status_code == 200, path
        assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"], path
    assert client.simulate_head("/v1/completions").status_code == 405  # POST routes stay POST


def test_generate_takes_logprobs_and_logprob_token_ids_as_vllms_engine_does(client):
    """vLLM's engine rule on generate's sampling params: both set, ``logprobs`` is the number of ids
    (the ids are what is listed); a different count is a 400, not a count silently dropped."""
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3, "temperature": 0, "logprobs": 2,
                                                       "logprob_token_ids": [5, 9]}}  # fmt: skip
    r = post(client, "/inference/v1/generate", body)
    assert r.status_code == 200, r.text
    for entry in r.json["choices"][0]["logprobs"]["content"]:  # the asked ids, beside the sampled token
        assert {"token_id:5", "token_id:9"} <= {t["token"] for t in entry["top_logprobs"]} <= {
            "token_id:5", "token_id:9", entry["token"]}  # fmt: skip
    body["sampling_params"]["logprobs"] = 1
    r = post(client, "/inference/v1/generate", body)
    assert r.status_code == 400 and r.json["error"]["param"] == "sampling_params.logprob_token_ids", r.text
