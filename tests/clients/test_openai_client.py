"""The official ``openai`` package against the live server: what users actually run."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_n_choices(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=5, seed=3, temperature=0.8,
        extra_body={"ignore_eos": True, "top_k": 20},
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in r.choices)
    assert r.usage.completion_tokens == 15


def test_chat_stream_n_choices(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4, seed=5, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert finishes == {0: ["length"], 1: ["length"]}
    assert usage is not None and usage.completion_tokens == 8
    final = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4, seed=5, extra_body={"ignore_eos": True},
    )
    assert [texts[c.index] for c in final.choices] == [c.message.content for c in final.choices]


def test_completions_and_stream(client):
    r = client.completions.create(model="tiny", prompt=["a b", "c d"], n=2, max_tokens=3, seed=1, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    seen = set()
    for chunk in client.completions.create(model="tiny", prompt="a b", n=2, max_tokens=3, seed=1, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            if c.finish_reason:
                seen.add((c.index, c.finish_reason))
    assert seen == {(0, "length"), (1, "length")}


def test_bad_request_names_param(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2, temperature=0)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], extra_body={"tools": []})
    assert info.value.body["param"] == "tools"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_reading_choices_zero_of_each_chunk_sees_every_choice(client):
    """Code written for OpenAI reads ``chunk.choices[0]``: with n > 1 every choice must arrive that way."""
    texts: dict[int, str] = {}
    finished = []
    for chunk in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=4, seed=9, stream=True,
        extra_body={"ignore_eos": True},
    ):
        choice = chunk.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason:
            finished.append(choice.index)
    assert sorted(finished) == [0, 1, 2]
    final = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=4, seed=9,
        extra_body={"ignore_eos": True},
    )
    assert [texts[c.index] for c in final.choices] == [c.message.content for c in final.choices]


def test_none_for_optional_fields_is_not_set(client):
    """The SDK's wrappers pass None through as null (``extra_body`` keeps it, as wrappers do)."""
    nulls = {"n": None, "logprobs": None, "stream": None, "seed": None, "stop": None, "echo": None, "user": None,
             "stream_options": None}  # fmt: skip
    r = client.completions.create(model="tiny", prompt="a b", max_tokens=3, temperature=0,
                                  extra_body={**nulls, "ignore_eos": True})  # fmt: skip
    plain = client.completions.create(model="tiny", prompt="a b", max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.text for c in r.choices] == [c.text for c in plain.choices] and len(r.choices) == 1
    chat_nulls = {**{k: v for k, v in nulls.items() if k != "echo"}, "top_logprobs": None}
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x", "name": None}],
                                          max_tokens=2, extra_body=chat_nulls)  # fmt: skip
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_the_sdk_sends_a_tool_conversation_back(client):
    """An agent loop resends the assistant message as the SDK parsed it (content None, tool_calls,
    reasoning_content) and the tool's answer; the tiny model's template renders no tool calls, so
    that field is refused by name, and without it the conversation renders."""
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    turns = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "content": "42", "tool_call_id": "call_1"}]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=turns, max_tokens=2)
    assert info.value.body["param"] == "messages.1.tool_calls"
    turns[1] = {"role": "assistant", "content": None, "reasoning_content": "thinking"}
    r = client.chat.completions.create(model="tiny", messages=turns, max_tokens=2, n=2, temperature=1,
                                       extra_body={"echo": None, "priority": None})  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].message.tool_calls == []


def test_generate_with_the_sdks_raw_post(client):
    """Token-in/token-out clients post vLLM's generate request; nulls are "not set" there too."""
    body = {"token_ids": [1, 5, 9], "sampling_params": {"max_tokens": 3, "n": 2, "seed": 1, "stop": None,
            "detokenize": False, "logprobs": 1, "prompt_logprobs": 1}, "priority": None}  # fmt: skip
    r = client.post("/../inference/v1/generate", body=body, cast_to=object)
    assert [c["index"] for c in r["choices"]] == [0, 1] and all(c["text"] is None for c in r["choices"])
    assert r["prompt_logprobs"][0] is None and all(
        set(entry) >= {"logprob", "rank", "decoded_token"} for position in r["prompt_logprobs"][1:] for entry in position.values()
    )


def test_parse_with_a_pydantic_model(client):
    """``chat.completions.parse`` sends a strict json_schema built from the model and parses the answer."""
    from typing import Literal

    import pydantic

    class Verdict(pydantic.BaseModel):
        answer: Literal["yes", "no"]
        confident: bool

    r = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "Is it?"}], response_format=Verdict,
                                      max_tokens=40, seed=1, temperature=0.5)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Verdict) and choice.message.parsed.answer in ("yes", "no")
