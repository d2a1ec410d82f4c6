"""vLLM's n-choices and streaming-shape tests, ported to the live server (``openai`` SDK and ``requests``).

Ports the n-related and streaming cases of:
- tests/entrypoints/openai/completion/test_completion.py (test_parallel_no_streaming,
  test_parallel_streaming, test_batch_completions, test_completion_streaming,
  test_completion_stream_options);
- tests/entrypoints/openai/chat_completion/test_chat.py (test_chat_completion_n_parameter_non_streaming,
  test_chat_completion_n_parameter_streaming, test_chat_completion_n_with_seed,
  test_chat_completion_n_equals_1, test_chat_streaming, test_chat_completion_stream_options).

The tiny model is random, so "choices finish at different times" is arranged with stop_token_ids
(every 8th id stops a choice); every check is on counts, indices, finish chunks and the equality of a
stream with the same seeded request answered whole.
"""

from __future__ import annotations

from collections import defaultdict

import openai
import pytest
import requests

from tests.helpers import chat_delta_text, sse_events, stream_by_choice

pytestmark = pytest.mark.live

PROMPT = "What is an LLM?"
#: vLLM's system + user turns, shortened: the live server's context is 64 tokens
MSG = [{"role": "user", "content": "What is the opposite of big?"}]
#: every 8th token id stops a choice: sampled choices then end after different numbers of tokens
STOPS = list(range(0, 512, 8))


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=60)


def check_lengths_and_finishes(choices, lengths: list[int], max_tokens: int) -> None:
    """A choice that stopped ended on one of STOPS before max_tokens; one cut at the limit has max_tokens."""
    for choice, length in zip(choices, lengths, strict=True):
        if choice.finish_reason == "stop":
            assert choice.stop_reason in STOPS and 1 <= length <= max_tokens
        else:
            assert choice.finish_reason == "length" and length == max_tokens


# ------------------------------------------------------------------ completions


def test_parallel_no_streaming(client):
    # vLLM: tests/entrypoints/openai/completion/test_completion.py::test_parallel_no_streaming
    n, max_tokens = 3, 40
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, n=n, temperature=1.0,
                                  stream=False, logprobs=0, seed=42, extra_body={"stop_token_ids": STOPS})  # fmt: skip
    assert [c.index for c in r.choices] == list(range(n))
    lengths = [len(c.logprobs.tokens) for c in r.choices]
    check_lengths_and_finishes(r.choices, lengths, max_tokens)
    assert len(set(lengths)) > 1, f"choices should finish at different times: {lengths}"
    assert len({c.text for c in r.choices}) == n, "n distinct samples"
    assert r.usage.completion_tokens == sum(lengths)


def test_parallel_streaming(client):
    # vLLM: tests/entrypoints/openai/completion/test_completion.py::test_parallel_streaming
    n, max_tokens = 3, 40
    texts: dict[int, str] = defaultdict(str)
    tokens: dict[int, int] = defaultdict(int)
    finishes: dict[int, list] = defaultdict(list)
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, n=n, temperature=1.0,
                                           stream=True, logprobs=0, seed=42, extra_body={"stop_token_ids": STOPS}):  # fmt: skip
        assert len(chunk.choices) == 1, "one choice per chunk"
        choice = chunk.choices[0]
        assert not finishes[choice.index], "nothing after a choice's finish chunk"
        texts[choice.index] += choice.text
        tokens[choice.index] += len(choice.logprobs.tokens)
        if choice.finish_reason is not None:
            finishes[choice.index].append((choice.finish_reason, choice.stop_reason))
    assert sorted(finishes) == list(range(n)) and all(len(f) == 1 for f in finishes.values())
    assert all(count <= max_tokens for count in tokens.values())
    assert len(set(tokens.values())) > 1, f"choices should finish at different times: {dict(tokens)}"
    assert len(set(texts.values())) == n
    # our contract: the stream is the same seeded request answered whole
    final = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, n=n, temperature=1.0,
                                      logprobs=0, seed=42, extra_body={"stop_token_ids": STOPS})  # fmt: skip
    for c in final.choices:
        assert texts[c.index] == c.text
        assert tokens[c.index] == len(c.logprobs.tokens)
        assert finishes[c.index] == [(c.finish_reason, c.stop_reason)]


def greedy_text(client, prompt) -> str:
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0.0).choices[0].text


@pytest.mark.parametrize("prompts", [["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2], ids=["text", "token-ids"])
def test_batch_completions(client, prompts):
    # vLLM: tests/entrypoints/openai/completion/test_completion.py::test_batch_completions
    batch = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0.0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == batch.choices[1].text
    # vLLM asks n=2 with beam search (a greedy n > 1); we have no beam search and refuse a greedy n > 1
    # (400 on n): a seeded sample gives the same property, as choice j of every prompt uses seed + j
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=5, temperature=0.0)
    assert info.value.body["param"] == "n"
    batch = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=5, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]  # prompt_index * n + j
    texts = [c.text for c in batch.choices]
    assert texts[0] != texts[1], "two samples of one prompt should differ"
    assert texts[0] == texts[2] and texts[1] == texts[3], "two copies of the same prompt should be the same"
    streamed = ["", ""]
    for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0.0, stream=True):
        assert len(chunk.choices) == 1
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed[0] == streamed[1] == greedy_text(client, prompts[0])


def test_completion_streaming(client):
    # vLLM: tests/entrypoints/openai/completion/test_completion.py::test_completion_streaming
    single = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0.0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    chunks, finish_count, last = [], 0, None
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True}):  # fmt: skip
        chunks.append(chunk.choices[0].text)
        finish_count += chunk.choices[0].finish_reason is not None
        last = chunk
    assert finish_count == 1, "the finish reason comes in the last chunk only"
    assert last.choices[0].finish_reason == "length"
    assert "".join(chunks) == single.choices[0].text


def usage_of_stream(server, path: str, body: dict) -> list[tuple[int, dict | None, bool]]:
    """``(number of choices, usage, has a finish)`` per chunk of a stream."""
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    return [(len(e["choices"]), e["usage"], any(c["finish_reason"] for c in e["choices"])) for e in events[:-1]]


ENDPOINTS = {
    "completions": ("/v1/completions", {"prompt": PROMPT}),
    "chat": ("/v1/chat/completions", {"messages": MSG}),
}


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@pytest.mark.parametrize("n", [1, 2])
def test_stream_options(live_server, endpoint, n):
    # vLLM: tests/entrypoints/openai/completion/test_completion.py::test_completion_stream_options
    # (and chat_completion/test_chat.py::test_chat_completion_stream_options), with n = 1 and 2
    path, base = ENDPOINTS[endpoint]
    body = {**base, "max_tokens": 5, "n": n, "temperature": 1.0, "seed": 3, "ignore_eos": True, "stream": True}
    for options in ({"include_usage": False, "continuous_usage_stats": False}, {}):
        chunks = usage_of_stream(live_server, path, {**body, "stream_options": options})
        assert all(usage is None for _, usage, _ in chunks)
    chunks = usage_of_stream(live_server, path, {**body, "stream_options": {"include_usage": True}})
    *data, (count, usage, _) = chunks
    assert all(usage is None and count == 1 for count, usage, _ in data)
    assert sum(finished for _, _, finished in data) == n
    assert count == 0 and usage["completion_tokens"] == 5 * n and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    r = post(live_server, path, {**body, "min_tokens": 5,
                                 "stream_options": {"include_usage": True, "continuous_usage_stats": True}})  # fmt: skip
    events = sse_events(r.text)
    per_choice: dict[int, list[int]] = defaultdict(list)
    for event in events[:-2]:
        usage = event["usage"]
        assert usage is not None and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        per_choice[event["choices"][0]["index"]].append(usage["completion_tokens"])
    assert sorted(per_choice) == list(range(n))
    for counts in per_choice.values():  # each choice's own tokens so far: never backwards, 5 at the end
        assert counts == sorted(counts) and counts[-1] == 5
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 5 * n
    for stream in (False, None):  # stream_options without a stream is refused, on the field
        for options in ({"include_usage": None}, {"include_usage": True}, {"continuous_usage_stats": None},
                        {"continuous_usage_stats": True}):  # fmt: skip
            r = post(live_server, path, {**base, "max_tokens": 2, "stream": stream, "stream_options": options})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_continuous_usage_needs_include_usage(live_server, endpoint):
    # vLLM: tests/entrypoints/openai/completion/test_completion.py::test_completion_stream_options
    # (the {"include_usage": False, "continuous_usage_stats": True} case: no chunk has usage)
    path, base = ENDPOINTS[endpoint]
    chunks = usage_of_stream(live_server, path, {**base, "max_tokens": 3, "temperature": 0.0, "stream": True,
                                                 "stream_options": {"include_usage": False, "continuous_usage_stats": True}})  # fmt: skip
    assert chunks and all(usage is None for _, usage, _ in chunks)


# ------------------------------------------------------------------ chat


def test_chat_completion_n_parameter_non_streaming(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat.py::test_chat_completion_n_parameter_non_streaming
    r = client.chat.completions.create(model="tiny", messages=MSG, max_completion_tokens=20, temperature=0.7, n=3,
                                       stream=False, seed=1, extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice in r.choices:
        assert choice.message.role == "assistant" and choice.message.content
        assert choice.finish_reason == "length"
    assert len({c.message.content for c in r.choices}) > 1, "expected different responses with n=3"
    assert r.usage.completion_tokens == 60


def test_chat_completion_n_parameter_streaming(live_server):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat.py::test_chat_completion_n_parameter_streaming
    # (with our stream shape: a role chunk per choice first, one choice per chunk, a finish chunk per choice)
    body = {"messages": MSG, "max_completion_tokens": 15, "temperature": 0.7, "n": 2, "seed": 8, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    r = post(live_server, "/v1/chat/completions", {**body, "stream": True})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    first_chunks = [e["choices"][0] for e in events[:2]]
    assert [(c["index"], c["delta"].get("role")) for c in first_chunks] == [(0, "assistant"), (1, "assistant")]
    joined = stream_by_choice(events, chat_delta_text)
    assert sorted(joined) == [0, 1]
    assert all(j["finishes"] == ["length"] and j["after_finish"] == 0 and j["text"] for j in joined.values())
    streamed_logprobs: dict[int, list] = defaultdict(list)
    for event in events[:-1]:
        for choice in event["choices"]:
            streamed_logprobs[choice["index"]] += (choice["logprobs"] or {"content": []})["content"]
    final = post(live_server, "/v1/chat/completions", body).json()
    for choice in final["choices"]:
        assert joined[choice["index"]]["text"] == choice["message"]["content"]
        content = choice["logprobs"]["content"]
        assert len(content) == 15 and all(len(e["top_logprobs"]) == 2 for e in content)
        assert [e["token"] for e in streamed_logprobs[choice["index"]]] == [e["token"] for e in content]


def test_chat_completion_n_with_seed(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat.py::test_chat_completion_n_with_seed
    messages = [{"role": "user", "content": "Say hello."}]
    kwargs = dict(model="tiny", messages=messages, max_completion_tokens=10, temperature=0.8,
                  extra_body={"ignore_eos": True})  # fmt: skip
    r = client.chat.completions.create(n=2, seed=42, **kwargs)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content for c in r.choices)
    again = client.chat.completions.create(n=2, seed=42, **kwargs)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    # our contract: choice i uses seed + i
    second = client.chat.completions.create(n=1, seed=43, **kwargs)
    assert second.choices[0].message.content == r.choices[1].message.content


def test_chat_completion_n_equals_1(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat.py::test_chat_completion_n_equals_1
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello!"}],
                                       max_completion_tokens=10, temperature=0.7, n=1, stream=False)  # fmt: skip
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].message.content is not None


def test_chat_streaming(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat.py::test_chat_streaming
    kwargs = dict(model="tiny", messages=MSG, max_completion_tokens=10, temperature=0.0)
    final = client.chat.completions.create(**kwargs)
    chunks, finish_count, roles, last = [], 0, [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        if delta.role:
            roles.append(delta.role)
        if delta.content:
            chunks.append(delta.content)
        finish_count += chunk.choices[0].finish_reason is not None
        last = chunk
    assert roles == ["assistant"]
    assert finish_count == 1
    assert last.choices[0].finish_reason == final.choices[0].finish_reason
    assert "".join(chunks) == final.choices[0].message.content
