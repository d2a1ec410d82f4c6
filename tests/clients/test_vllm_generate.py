"""vLLM's ``/inference/v1/generate`` (token-in, token-out) tests, ported to the live server over HTTP.

Ports:
- tests/entrypoints/serve/disagg/test_serving_tokens.py (live-server tests; the LoRA case is skipped:
  no adapters here);
- tests/entrypoints/serve/disagg/test_generate_stream.py (vLLM drives the serving class with a mocked
  engine; here the same stream properties are checked on real streams. The mid-stream engine-error
  cases cannot be provoked from outside and prompt_tokens_details is not served: both skipped);
- tests/entrypoints/serve/disagg/test_tokens_logprobs.py (unit tests of the logprobs builder, checked
  on real responses);
- tests/entrypoints/serve/disagg/test_protocol.py (``max_tokens`` omitted vs given, observed as lengths).

Contract differences, deliberate: unknown fields such as ``kv_transfer_params`` are refused with 400
(vLLM accepts them), and ``n > 1`` returns every choice (vLLM refuses n > 1 on this route).
"""

from __future__ import annotations

import pytest
import requests

from tests.helpers import sse_events, stream_by_choice

pytestmark = pytest.mark.live

GEN = "/inference/v1/generate"
CHAT = "/v1/chat/completions"
PROMPT = [1, 2, 3]
LIVE_MAX_MODEL_LEN = 64
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many?"}]


def post(server, path: str, body: dict, **kwargs) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=60, **kwargs)


def ok(r: requests.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def generate(server, sampling_params: dict | None = None, **top) -> dict:
    body = {"token_ids": PROMPT, **top}
    if sampling_params is not None:
        body["sampling_params"] = sampling_params
    return ok(post(server, GEN, body))


def stream_events(server, body: dict, **kwargs) -> list:
    r = post(server, GEN, {"stream": True, **body}, **kwargs)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]", "a stream ends with [DONE]"
    assert all("error" not in e for e in events[:-1]), events
    return events[:-1]


def token_id(name: str) -> int:
    assert name.startswith("token_id:"), name
    return int(name.removeprefix("token_id:"))


def chat_prompt_ids(server, messages=MESSAGES) -> list[int]:
    return ok(post(server, "/tokenize", {"messages": messages}))["tokens"]


# ------------------------------------------------------------------ test_serving_tokens.py


def test_generate_endpoint(live_server):
    # vLLM: tests/entrypoints/serve/disagg/test_serving_tokens.py::test_generate_endpoint
    body = generate(live_server, {"max_tokens": 5, "ignore_eos": True}, model="tiny", stream=False)
    assert body["model"] == "tiny" and body["request_id"].startswith("generate-tokens-")
    assert isinstance(body["created"], int) and body["prompt_logprobs"] is None
    (choice,) = body["choices"]
    assert choice["index"] == 0 and len(choice["token_ids"]) == 5 and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None and isinstance(choice["text"], str)
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_generate_defaults_max_tokens_when_omitted(live_server):
    # vLLM: tests/entrypoints/serve/disagg/test_serving_tokens.py::test_generate_defaults_max_tokens_when_omitted
    # (and test_protocol.py::test_omitted_max_tokens_is_not_provided): no cap at SamplingParams' 16
    body = generate(live_server, {"temperature": 0.0, "ignore_eos": True})
    (choice,) = body["choices"]
    assert len(choice["token_ids"]) == LIVE_MAX_MODEL_LEN - len(PROMPT) > 16
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])


def test_explicit_max_tokens_is_honoured(live_server):
    # vLLM: tests/entrypoints/serve/disagg/test_protocol.py::test_explicit_max_tokens_is_provided
    # (and ::test_other_fields_tracked_independently: temperature alone leaves max_tokens unset)
    for max_tokens in (16, 20):
        (choice,) = generate(live_server, {"max_tokens": max_tokens, "ignore_eos": True})["choices"]
        assert len(choice["token_ids"]) == max_tokens
    (choice,) = generate(live_server, {"temperature": 0.5, "ignore_eos": True})["choices"]
    assert len(choice["token_ids"]) == LIVE_MAX_MODEL_LEN - len(PROMPT)


def test_generate_stream(live_server):
    # vLLM: tests/entrypoints/serve/disagg/test_serving_tokens.py::test_generate_stream
    # (and test_generate_stream.py::test_stream_basic / ::test_stream_skips_empty_token_output)
    events = stream_events(live_server, {"model": "tiny", "token_ids": PROMPT,
                                         "sampling_params": {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}})  # fmt: skip
    streamed = []
    for chunk in events:
        assert len(chunk["choices"]) == 1
        (choice,) = chunk["choices"]
        assert choice["index"] == 0 and choice["token_ids"], "no chunk without new tokens"
        streamed += choice["token_ids"]
    assert [c["choices"][0]["finish_reason"] for c in events] == [None] * (len(events) - 1) + ["length"]
    assert all(c["usage"] is None and c["prompt_logprobs"] is None for c in events)
    final = generate(live_server, {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}, model="tiny")
    # vLLM only compares counts; greedy decoding gives the same tokens and the same text
    assert streamed == final["choices"][0]["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in events) == final["choices"][0]["text"]


@pytest.mark.parametrize("logprobs", [0, 1, 5])
def test_generate_logprobs(live_server, logprobs):
    # vLLM: tests/entrypoints/serve/disagg/test_serving_tokens.py::test_generate_logprobs
    body = generate(live_server, {"max_tokens": 5, "temperature": 0.0, "logprobs": logprobs})
    (choice,) = body["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"])
    for entry, sampled in zip(content, choice["token_ids"], strict=True):
        assert token_id(entry["token"]) == sampled
        top = entry["top_logprobs"]
        assert len(top) == max(logprobs, 1)  # greedy: the sampled token is the most likely one
        ids = [token_id(t["token"]) for t in top]
        assert ids[0] == sampled and len(set(ids)) == len(ids)
        assert top[0]["logprob"] == pytest.approx(entry["logprob"])
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True) and all(v <= 0.0 for v in values)


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_same_response_as_chat_completions(live_server, ignore_eos):
    # vLLM: tests/entrypoints/serve/disagg/test_serving_tokens.py::test_same_response_as_chat_completions
    token_ids = chat_prompt_ids(live_server)
    gen = generate(live_server, {"max_tokens": 24, "temperature": 0.0, "detokenize": False, "ignore_eos": ignore_eos},
                   token_ids=token_ids)["choices"][0]  # fmt: skip
    assert gen["text"] is None, "detokenize false: token ids only"
    chat = ok(post(live_server, CHAT, {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "temperature": 0.0,
                                       "stream": False, "ignore_eos": ignore_eos, "return_token_ids": True}))  # fmt: skip
    assert chat["prompt_token_ids"] == token_ids
    # stronger than vLLM's decoded-text comparison: the very same token ids, and the same text once decoded
    assert gen["token_ids"] == chat["choices"][0]["token_ids"]
    text = generate(live_server, {"max_tokens": 24, "temperature": 0.0, "ignore_eos": ignore_eos},
                    token_ids=token_ids)["choices"][0]["text"]  # fmt: skip
    assert text == chat["choices"][0]["message"]["content"]


def pick_stop_string(text: str) -> tuple[str, int]:
    """Two printable ASCII characters from the middle of ``text`` and where they first occur."""
    for i in range(3, len(text) - 2):
        candidate = text[i:i + 2]
        if candidate.isascii() and candidate.isprintable() and candidate.strip() == candidate:
            return candidate, text.find(candidate)
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_workflow(live_server):
    # vLLM: tests/entrypoints/serve/disagg/test_serving_tokens.py::test_stop_string_workflow
    token_ids = chat_prompt_ids(live_server)
    sampling = {"max_tokens": 24, "temperature": 0.0, "detokenize": False, "ignore_eos": True}
    r = post(live_server, GEN, {"token_ids": token_ids, "sampling_params": {**sampling, "stop": ["27 member"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.stop", r.text
    # null stop means "not set"; X-Request-Id names the request
    r = post(live_server, GEN, {"token_ids": token_ids, "sampling_params": {**sampling, "stop": None}},
             headers={"X-Request-Id": "42"})  # fmt: skip
    body = ok(r)
    assert body["request_id"] == "generate-tokens-42"
    generated = body["choices"][0]["token_ids"]
    text = ok(post(live_server, "/detokenize", {"tokens": generated}))["prompt"]
    # the coordinator's job in vLLM: find the stop string in the decoded text and cut there
    stop, cut = pick_stop_string(text)
    chat = ok(post(live_server, CHAT, {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "temperature": 0.0,
                                       "ignore_eos": True, "stop": [stop]}))  # fmt: skip
    assert chat["choices"][0]["message"]["content"] == text[:cut]
    assert chat["choices"][0]["finish_reason"] == "stop" and chat["choices"][0]["stop_reason"] == stop


def test_generate_with_kv_transfer_params_is_refused(live_server):
    # vLLM: tests/entrypoints/serve/disagg/test_serving_tokens.py::test_generate_with_kv_transfer_params
    # contract difference: no KV transfer here, and an unknown field is a 400 naming it, never ignored
    r = post(live_server, GEN, {"model": "tiny", "token_ids": PROMPT, "sampling_params": {"max_tokens": 5},
                                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
                                "stream": False})  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_transfer_params" and error["code"] == 400 and "kv_transfer_params" in error["message"]


@pytest.mark.parametrize("sampling_params", ["absent", None])
def test_generate_without_sampling_params(live_server, sampling_params):
    # vLLM: tests/entrypoints/serve/disagg/test_serving_tokens.py::test_generate_without_sampling_params
    body = {"model": "tiny", "token_ids": PROMPT, "stream": False}
    if sampling_params != "absent":
        body["sampling_params"] = sampling_params
    choices = ok(post(live_server, GEN, body))["choices"]
    assert len(choices) == 1 and choices[0]["token_ids"] and choices[0]["finish_reason"] in ("stop", "length")


# ------------------------------------------------------------------ test_generate_stream.py


def test_stream_include_usage(live_server):
    # vLLM: tests/entrypoints/serve/disagg/test_generate_stream.py::test_stream_include_usage
    events = stream_events(live_server, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "ignore_eos": True},
                                         "stream_options": {"include_usage": True}})  # fmt: skip
    *data, usage_chunk = events
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in data)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_stream_continuous_usage(live_server):
    # vLLM: tests/entrypoints/serve/disagg/test_generate_stream.py::test_stream_continuous_usage
    events = stream_events(live_server, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3, "ignore_eos": True},
                                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}})  # fmt: skip
    data = [c for c in events if c["choices"]]
    so_far = 0
    for chunk in data:
        so_far += len(chunk["choices"][0]["token_ids"])
        assert chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": so_far, "total_tokens": 3 + so_far}
    assert so_far == 3 and events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3


def test_stream_with_logprobs(live_server):
    # vLLM: tests/entrypoints/serve/disagg/test_generate_stream.py::test_stream_with_logprobs
    sampling = {"max_tokens": 4, "logprobs": 1, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    events = stream_events(live_server, {"token_ids": PROMPT, "sampling_params": sampling})
    streamed = []
    for chunk in events:
        (choice,) = chunk["choices"]
        content = choice["logprobs"]["content"]
        assert len(content) == len(choice["token_ids"])
        assert [token_id(e["token"]) for e in content] == choice["token_ids"]
        streamed += content
    final = generate(live_server, sampling)["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in streamed] == [e["token"] for e in final]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in final], abs=1e-5)


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_of_n(live_server, stream):
    # vLLM: tests/entrypoints/serve/disagg/test_generate_stream.py::test_stream_basic, with n = 3
    # contract difference: vLLM refuses n > 1 on this route; we return all n choices, indices 0..n-1
    sampling = {"max_tokens": 4, "n": 3, "temperature": 1.0, "seed": 21, "ignore_eos": True}
    final = generate(live_server, sampling)
    assert [c["index"] for c in final["choices"]] == [0, 1, 2]
    assert all(len(c["token_ids"]) == 4 and c["finish_reason"] == "length" for c in final["choices"])
    assert final["usage"]["completion_tokens"] == 12
    assert len({tuple(c["token_ids"]) for c in final["choices"]}) > 1
    if stream:
        events = stream_events(live_server, {"token_ids": PROMPT, "sampling_params": sampling})
        joined = stream_by_choice(events + ["[DONE]"])
        assert sorted(joined) == [0, 1, 2]
        for c in final["choices"]:
            got = joined[c["index"]]
            assert got["finishes"] == ["length"] and got["after_finish"] == 0
            assert got["token_ids"] == c["token_ids"] and got["text"] == c["text"]


# ------------------------------------------------------------------ test_tokens_logprobs.py


def first_position(server, logprobs: int, forced: int) -> dict:
    body = generate(server, {"max_tokens": 1, "logprobs": logprobs, "allowed_token_ids": [forced]})
    (entry,) = body["choices"][0]["logprobs"]["content"]
    assert token_id(entry["token"]) == forced
    return entry


def test_top_logprobs_alternatives_have_own_token_ids(live_server):
    # vLLM: tests/entrypoints/serve/disagg/test_tokens_logprobs.py::test_top_logprobs_alternatives_have_own_token_ids
    best = [token_id(t["token"]) for t in first_position(live_server, 5, 0)["top_logprobs"]]
    forced = next(i for i in range(100, 512) if i not in best)  # a token that is not among the 5 most likely
    entry = first_position(live_server, 2, forced)
    ids = [token_id(t["token"]) for t in entry["top_logprobs"]]
    assert len(ids) == len(set(ids)) == 3, "the 2 most likely plus the sampled one, each under its own id"
    assert set(ids) == {*best[:2], forced}
    listed = {token_id(t["token"]): t["logprob"] for t in entry["top_logprobs"]}
    assert listed[forced] == pytest.approx(entry["logprob"])
    assert listed[forced] <= min(listed[i] for i in best[:2])


def test_logprobs_zero_emits_sampled_token(live_server):
    # vLLM: tests/entrypoints/serve/disagg/test_tokens_logprobs.py::test_logprobs_zero_emits_sampled_token
    entry = first_position(live_server, 0, 300)
    assert [token_id(t["token"]) for t in entry["top_logprobs"]] == [300]
    assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])


def test_sampling_field_errors_name_sampling_params(live_server):
    # vLLM: tests/entrypoints/openai/completion/test_completion.py::test_too_many_completion_logprobs, on generate
    for field, value in (("logprobs", 21), ("top_k", -5), ("logprob_token_ids", [512])):
        r = post(live_server, GEN, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "logprobs": 1, field: value}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == f"sampling_params.{field}"
    r = post(live_server, GEN, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "logprobs": 30}, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.logprobs"
    assert generate(live_server, {"max_tokens": 2})["choices"][0]["token_ids"], "the server still works afterwards"
