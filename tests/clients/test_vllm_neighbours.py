"""vLLM's tests around token ids, echo, logprobs and request validation, ported to the live server.

Ports:
- tests/entrypoints/openai/basic/test_return_token_ids.py (the tool-use case without its tools);
- tests/entrypoints/openai/chat_completion/test_chat_echo.py;
- tests/entrypoints/openai/chat_completion/test_token_in_token_out.py and
  completion/test_token_in_token_out.py;
- completion/test_completion_logprobs.py, completion/test_completion_text_offset.py,
  completion/test_empty_prompt_list.py, completion/test_prompt_validation.py (the prompt_embeds
  loading and hidden-state cases are skipped: no prompt embeddings or hidden states here);
- chat_completion/test_chat_stop_token_ids_validation.py, chat_completion/test_chat_logit_bias_validation.py;
- the logprobs / usage / seed cases of completion/test_completion.py and chat_completion/test_chat.py
  (structured outputs, LoRA, custom roles and /invocations are skipped: not served here).

Several of vLLM's tests call unit-level helpers or build pydantic models; here the same behaviour is
observed over HTTP. vLLM's prompts are shortened to fit the live server's 64-token context.
"""

from __future__ import annotations

import openai
import pytest
import requests

from tests.helpers import ok, refused, sse_events

pytestmark = pytest.mark.live

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
VOCAB = 512


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=60)


def tokenize(server, **body) -> list[int]:
    return ok(post(server, "/tokenize", body))["tokens"]


def detokenize(server, tokens: list[int]) -> str:
    return ok(post(server, "/detokenize", {"tokens": tokens}))["prompt"]


def token_id(name: str) -> int:
    assert name.startswith("token_id:"), name
    return int(name.removeprefix("token_id:"))


def bad_request(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    return info.value


# ------------------------------------------------------------------ basic/test_return_token_ids.py


def test_basic_completion_with_emoji(live_server, client):
    # vLLM: tests/entrypoints/openai/basic/test_return_token_ids.py::test_basic_completion_with_emoji
    prompt = "Complete with emojis: I love coding 🚀"
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=1)
    completion = client.completions.create(**kwargs, extra_body={"return_token_ids": True})
    choice = completion.choices[0]
    assert "prompt_token_ids" in completion.model_dump()["choices"][0]
    # vLLM checks the encoded prompt is a subsequence; completions add no special tokens here: equal
    assert choice.prompt_token_ids == tokenize(live_server, prompt=prompt)
    assert isinstance(choice.token_ids, list) and len(choice.token_ids) == completion.usage.completion_tokens > 0
    assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens) == len(choice.token_ids)
    assert detokenize(live_server, choice.token_ids).startswith(choice.text)
    without = client.completions.create(**kwargs, extra_body={"return_token_ids": False}).model_dump()
    assert without["choices"][0].get("token_ids") is None
    assert without["choices"][0].get("prompt_token_ids") is None and without.get("prompt_token_ids") is None


def test_comparison_with_prompt_logprobs_and_logprobs(live_server, client):
    # vLLM: tests/entrypoints/openai/basic/test_return_token_ids.py::test_comparison_with_prompt_logprobs_and_logprobs
    completion = client.completions.create(
        model="tiny", prompt="Hello, world! How are you today?", max_tokens=20, temperature=0, echo=True, logprobs=1,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "prompt_logprobs": 1},
    )
    choice = completion.choices[0]
    assert choice.token_ids and choice.prompt_token_ids and choice.prompt_logprobs and choice.logprobs
    logprob_ids = [token_id(t) for t in choice.logprobs.tokens]
    # echo: the prompt's positions first, then the generated ones (vLLM checks the suffix only)
    assert logprob_ids == choice.prompt_token_ids + choice.token_ids
    assert len(choice.prompt_logprobs) == len(choice.prompt_token_ids) and choice.prompt_logprobs[0] is None
    for position, prompt_id in zip(choice.prompt_logprobs[1:], choice.prompt_token_ids[1:], strict=True):
        assert str(prompt_id) in position and 1 <= len(position) <= 2
    assert "Hello, world" in detokenize(live_server, choice.prompt_token_ids)
    assert choice.text.endswith(detokenize(live_server, choice.token_ids))

    prompt = "Tell me a short fact:"
    streamed_prompt_ids, streamed_ids, streamed_logprob_ids, chunks = None, [], [], 0
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                           echo=False, logprobs=1,
                                           extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True}):  # fmt: skip
        streamed_logprob_ids += [token_id(t) for t in chunk.choices[0].logprobs.tokens]
        if chunks == 0:
            streamed_prompt_ids = chunk.choices[0].prompt_token_ids
        else:
            assert chunk.choices[0].prompt_token_ids is None, "the prompt's ids come once, on the first chunk"
        streamed_ids += chunk.choices[0].token_ids
        chunks += 1
    assert streamed_prompt_ids == tokenize(live_server, prompt=prompt)
    assert streamed_ids == streamed_logprob_ids and len(streamed_ids) > 0


def test_chat_completion_with_emoji_and_token_ids(live_server, client):
    # vLLM: tests/entrypoints/openai/basic/test_return_token_ids.py::test_chat_completion_with_emoji_and_token_ids
    # (and ::test_chat_completion_with_tool_use without its tools: return_token_ids false leaves both null)
    messages = [{"role": "system", "content": "Use emojis."}, {"role": "user", "content": "I love cats 🐱"}]
    kwargs = dict(model="tiny", messages=messages, max_tokens=12, temperature=0)
    response = client.chat.completions.create(**kwargs, logprobs=True, extra_body={"return_token_ids": True})
    assert "prompt_token_ids" in response.model_dump()
    decoded_prompt = detokenize(live_server, response.prompt_token_ids)
    assert "Use emojis." in decoded_prompt and "I love cats 🐱" in decoded_prompt
    assert response.prompt_token_ids == tokenize(live_server, messages=messages)
    token_ids = response.choices[0].token_ids
    assert len(token_ids) == response.usage.completion_tokens == len(response.choices[0].logprobs.content)
    assert response.choices[0].message.content is not None

    first, collected_content, collected_ids = True, "", []
    for chunk in client.chat.completions.create(**kwargs, stream=True, extra_body={"return_token_ids": True}):
        dump = chunk.model_dump()
        if first:
            assert chunk.prompt_token_ids == response.prompt_token_ids
            first = False
        else:
            assert "prompt_token_ids" not in dump, "subsequent chunks should not have prompt_token_ids"
        if chunk.choices:
            collected_content += chunk.choices[0].delta.content or ""
            collected_ids += dump["choices"][0].get("token_ids") or []
    assert collected_ids == token_ids
    assert collected_content == response.choices[0].message.content

    without = client.chat.completions.create(**kwargs, logprobs=True, extra_body={"return_token_ids": False})
    assert without.choices[0].token_ids is None and without.prompt_token_ids is None


# ------------------------------------------------------------------ chat_completion/test_chat_echo.py

SAYING = "An apple a day, keeps"
ECHO_MESSAGES = [{"role": "user", "content": "tell me a saying"}, {"role": "assistant", "content": SAYING}]


@pytest.mark.parametrize("echo", [True, False])
def test_chat_session_with_echo_and_continue_final_message(client, echo):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat_echo.py::test_chat_session_with_echo_and_continue_final_message
    # vLLM's real model ends on its own ("stop"); the random model is cut by max_tokens instead
    completion = client.chat.completions.create(
        model="tiny", messages=ECHO_MESSAGES, max_tokens=5,
        extra_body={"echo": echo, "continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True},
    )
    assert completion.id is not None and len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.message.content.startswith(SAYING) is echo
    assert (SAYING in choice.message.content) is echo


def test_chat_echo_with_n_choices_streamed(live_server):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat_echo.py::test_chat_session_with_echo_and_continue_final_message
    # with n = 2, streamed and not: every choice starts with the echoed turn
    body = {"messages": ECHO_MESSAGES, "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 4, "echo": True,
            "continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}  # fmt: skip
    final = ok(post(live_server, CHAT, body))
    assert [c["index"] for c in final["choices"]] == [0, 1]
    assert all(c["message"]["content"].startswith(SAYING) for c in final["choices"])
    events = sse_events(ok_stream(live_server, body))
    texts = {0: "", 1: ""}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert [texts[c["index"]] for c in final["choices"]] == [c["message"]["content"] for c in final["choices"]]


def ok_stream(server, body: dict) -> str:
    r = post(server, CHAT, {**body, "stream": True})
    assert r.status_code == 200, r.text
    return r.text


def test_prompt_logprobs_and_top_logprobs_minus_one(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat_echo.py::test_prompt_logprobs (and ::test_top_logprobs)
    # contract difference: vLLM reads -1 as "the whole vocabulary" (its server allows that many);
    # ours bounds both counts by max_logprobs (20) and refuses -1 on the field; the largest count works
    messages = [{"role": "system", "content": "Be helpful."}, {"role": "user", "content": "Capital of China?"}]
    error = bad_request(lambda: client.chat.completions.create(model="tiny", messages=messages,
                                                               extra_body={"prompt_logprobs": -1}))  # fmt: skip
    assert error.body["param"] == "prompt_logprobs"
    error = bad_request(lambda: client.chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                                               extra_body={"top_logprobs": -1, "logprobs": True}))  # fmt: skip
    assert error.body["param"] == "top_logprobs"
    completion = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, logprobs=True,
                                                top_logprobs=20, extra_body={"prompt_logprobs": 20})  # fmt: skip
    assert len(completion.prompt_logprobs) == completion.usage.prompt_tokens
    assert completion.prompt_logprobs[0] is None and all(20 <= len(p) <= 21 for p in completion.prompt_logprobs[1:])
    assert len(completion.choices[0].logprobs.content[0].top_logprobs) == 20


# ------------------------------------------------------------------ token in, token out


def test_chat_token_in_matches_messages(live_server):
    # vLLM: tests/entrypoints/openai/chat_completion/test_token_in_token_out.py::test_chat_token_in_matches_messages
    # chat takes messages only here: pre-tokenized input goes to completions, which must answer the same
    messages = [{"role": "user", "content": "Hello, how are you today?"}]
    prompt_ids = tokenize(live_server, messages=messages)
    baseline = ok(post(live_server, CHAT, {"messages": messages, "max_completion_tokens": 16, "temperature": 0,
                                           "return_token_ids": True}))  # fmt: skip
    assert baseline["prompt_token_ids"] == prompt_ids
    token_in = ok(post(live_server, COMPLETIONS, {"prompt": prompt_ids, "max_tokens": 16, "temperature": 0,
                                                  "return_token_ids": True}))["choices"][0]  # fmt: skip
    assert token_in["prompt_token_ids"] == prompt_ids
    assert token_in["token_ids"] == baseline["choices"][0]["token_ids"]
    assert token_in["text"] == baseline["choices"][0]["message"]["content"]


def test_chat_token_in_is_refused(live_server):
    # vLLM: tests/entrypoints/openai/chat_completion/test_token_in_token_out.py::test_chat_token_in_rejects_template_option
    # contract difference: chat has no prompt_token_ids field at all, so it is refused on that field
    messages = [{"role": "user", "content": "Hello"}]
    r = post(live_server, CHAT, {"messages": messages, "max_completion_tokens": 4, "add_generation_prompt": True,
                                 "prompt_token_ids": tokenize(live_server, messages=messages)})  # fmt: skip
    refused(r, "prompt_token_ids")


def test_token_in_token_out_and_logprobs(live_server, client):
    # vLLM: tests/entrypoints/openai/completion/test_token_in_token_out.py::test_token_in_token_out_and_logprobs
    text = "Hello, world! How are you today?"
    token_ids = tokenize(live_server, prompt=text)
    completion = client.completions.create(model="tiny", prompt=token_ids, max_tokens=8, temperature=0, echo=True,
                                           extra_body={"return_token_ids": True})  # fmt: skip
    choice = completion.choices[0]
    assert choice.token_ids is not None and 0 < len(choice.token_ids) <= 8
    assert choice.prompt_token_ids == token_ids
    assert detokenize(live_server, choice.prompt_token_ids) == text
    assert choice.text.startswith(text)


# ------------------------------------------------------------------ completion logprobs / text offsets


def forced_non_top(server, body: dict, path: str) -> tuple[int, int]:
    """(the most likely first token, a different id to force) for ``body``'s first position."""
    probe = ok(post(server, path, {**body, "max_tokens": 1, "temperature": 0}))["choices"][0]
    lp = probe["logprobs"]
    top = token_id(lp["tokens"][0] if path == COMPLETIONS else lp["content"][0]["token"])
    return top, (300 if top != 300 else 301)


def test_completion_logprobs_sampled_token_outside_top(live_server):
    # vLLM: tests/entrypoints/openai/completion/test_completion_logprobs.py::test_completion_logprobs_handles_sampled_token_absent_from_step
    # our contract lists the sampled token next to the k best, so its logprob is always known (never null)
    body = {"prompt": [1, 87, 85], "logprobs": 1, "return_tokens_as_token_ids": True}
    top, forced = forced_non_top(live_server, body, COMPLETIONS)
    forced_body = {**body, "max_tokens": 1, "allowed_token_ids": [forced]}
    lp = ok(post(live_server, COMPLETIONS, forced_body))["choices"][0]["logprobs"]
    assert [token_id(t) for t in lp["tokens"]] == [forced]
    listed = {token_id(k): v for k, v in lp["top_logprobs"][0].items()}
    assert set(listed) == {top, forced}
    assert lp["token_logprobs"][0] is not None and lp["token_logprobs"][0] == pytest.approx(listed[forced])
    assert listed[forced] <= listed[top]
    # chat (the path vLLM fixed first): top_logprobs lists exactly the k best, the token keeps its own logprob
    chat_body = {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 1,
                 "return_tokens_as_token_ids": True}  # fmt: skip
    top, forced = forced_non_top(live_server, chat_body, CHAT)
    forced_body = {**chat_body, "max_tokens": 1, "allowed_token_ids": [forced]}
    (entry,) = ok(post(live_server, CHAT, forced_body))["choices"][0]["logprobs"]["content"]
    assert token_id(entry["token"]) == forced and [token_id(t["token"]) for t in entry["top_logprobs"]] == [top]
    assert entry["logprob"] <= entry["top_logprobs"][0]["logprob"]


def test_stream_text_offset_matches_non_stream_with_stop_holdback(live_server):
    # vLLM: tests/entrypoints/openai/completion/test_completion_text_offset.py::test_stream_text_offset_matches_non_stream_with_stop_holdback
    body = {"prompt": "Hi there", "max_tokens": 12, "temperature": 0, "logprobs": 0, "ignore_eos": True}
    first = ok(post(live_server, COMPLETIONS, body))["choices"][0]
    text, tokens = first["text"], first["logprobs"]["tokens"]
    held = next(t[-1] for t in tokens[2:] if t.isascii() and t[-1].isalnum())
    # a stop string starting with the last character of a generated token but never matching: that
    # character is held back a moment while streaming, so the stream's text lags its tokens (vLLM's case)
    body["stop"] = [held + "\u0001\u0002never"]
    final = ok(post(live_server, COMPLETIONS, body))["choices"][0]
    assert final["text"] == text and final["finish_reason"] == "length"
    lp = final["logprobs"]
    offsets, at = [], 0
    for token in lp["tokens"]:
        offsets.append(at)
        at += len(token)
    assert lp["text_offset"] == offsets
    r = post(live_server, COMPLETIONS, {**body, "stream": True})
    assert r.status_code == 200, r.text
    stream_offsets, stream_text, lagged, merged = [], "", False, False
    for event in sse_events(r.text)[:-1]:
        for choice in event["choices"]:
            stream_offsets += choice["logprobs"]["text_offset"]
            stream_text += choice["text"]
            chunk_tokens = "".join(choice["logprobs"]["tokens"])
            lagged |= chunk_tokens.isascii() and choice["text"] != chunk_tokens
            merged |= len(choice["logprobs"]["tokens"]) > 1
    # a reader that lags (a loaded machine) gets merged deltas, in which the held-back character can
    # arrive with its token: the lag is only visible when every event carried one token
    assert lagged or merged, "the stop string's first character should have been held back once"
    assert stream_offsets == lp["text_offset"]
    assert stream_text == text


# ------------------------------------------------------------------ prompt validation


def test_empty_prompt_list_rejected(live_server):
    # vLLM: tests/entrypoints/openai/completion/test_empty_prompt_list.py::test_empty_prompt_list_rejected
    for prompt in ([], "", [""], [[]]):
        r = post(live_server, COMPLETIONS, {"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] in ("prompt", "prompt.0"), r.text


def test_nonempty_prompt_list_ok(live_server):
    # vLLM: tests/entrypoints/openai/completion/test_empty_prompt_list.py::test_nonempty_prompt_list_ok
    body = ok(post(live_server, COMPLETIONS, {"prompt": ["hello"], "max_tokens": 2}))
    assert len(body["choices"]) == 1 and body["usage"]["prompt_tokens"] == len(tokenize(live_server, prompt="hello"))


def test_empty_prompt(live_server):
    # vLLM: tests/entrypoints/openai/completion/test_prompt_validation.py::test_empty_prompt
    # no prompt_embeds here: that field is refused on its name; a null prompt is refused on "prompt"
    r = post(live_server, COMPLETIONS, {"prompt": None, "max_tokens": 5, "temperature": 0.0, "prompt_embeds": []})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("prompt", "prompt_embeds"), r.text
    refused(post(live_server, COMPLETIONS, {"prompt": None, "max_tokens": 5}), "prompt")


def test_out_of_vocab_token_ids(client):
    # vLLM: tests/entrypoints/openai/completion/test_prompt_validation.py::test_out_of_vocab_token_ids
    error = bad_request(lambda: client.completions.create(model="tiny", prompt=[999999], max_tokens=5, temperature=0.0))
    assert error.body["param"] == "prompt"
    assert "999999" in error.message and "vocabulary" in error.message


# ------------------------------------------------------------------ stop_token_ids / logit_bias validation

MSG = [{"role": "user", "content": "Testing"}]


def test_chat_stop_token_ids_valid(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat_stop_token_ids_validation.py::test_chat_stop_token_ids_valid
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5, extra_body={"stop_token_ids": [VOCAB - 1]})
    assert r.choices[0].message.content is not None


def test_chat_stop_token_ids_out_of_vocab(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat_stop_token_ids_validation.py::test_chat_stop_token_ids_out_of_vocab
    error = bad_request(lambda: client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5,
                                                               extra_body={"stop_token_ids": [VOCAB + 1]}))  # fmt: skip
    assert str(VOCAB + 1) in error.message and str(VOCAB) in error.message
    assert error.body["param"] == "stop_token_ids"


def test_chat_stop_token_ids_negative(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat_stop_token_ids_validation.py::test_chat_stop_token_ids_negative
    error = bad_request(lambda: client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5,
                                                               extra_body={"stop_token_ids": [-1]}))  # fmt: skip
    assert error.body["param"].startswith("stop_token_ids")


def test_chat_logit_bias_valid(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py::test_chat_logit_bias_valid
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5, logit_bias={str(VOCAB - 1): 1.0})
    assert r.choices[0].message.content is not None


def test_chat_logit_bias_invalid(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py::test_chat_logit_bias_invalid
    error = bad_request(lambda: client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5,
                                                               logit_bias={str(VOCAB + 1): 1.0}))  # fmt: skip
    assert str(VOCAB + 1) in error.message and str(VOCAB) in error.message
    assert error.body["param"] == "logit_bias"


def test_chat_logit_bias_non_integer_key(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py::test_chat_logit_bias_non_integer_key
    error = bad_request(lambda: client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5,
                                                               logit_bias={"not_a_token_id": 50}))  # fmt: skip
    assert "not_a_token_id" in error.message and "logit_bias" in error.message
    assert error.body["param"].startswith("logit_bias")


def test_chat_logit_bias_non_numeric_value(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py::test_chat_logit_bias_non_numeric_value
    error = bad_request(lambda: client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5,
                                                               logit_bias={"1": "not_a_number"}))  # fmt: skip
    assert "logit_bias" in error.message and error.body["param"].startswith("logit_bias")


def test_chat_logit_bias_multiple_non_integer_keys(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py::test_chat_logit_bias_multiple_non_integer_keys
    error = bad_request(lambda: client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5,
                                                               logit_bias={"bad1": 50.0, "bad2": 20.0}))  # fmt: skip
    assert "bad1" in error.message and "bad2" in error.message


# ------------------------------------------------------------------ completion/test_completion.py


def test_single_completion(live_server, client):
    # vLLM: tests/entrypoints/openai/completion/test_completion.py::test_single_completion
    completion = client.completions.create(model="tiny", prompt="Hello, my name is", max_tokens=5, temperature=0.0,
                                           extra_body={"ignore_eos": True})  # fmt: skip
    assert completion.id is not None and len(completion.choices) == 1
    assert completion.choices[0].finish_reason == "length"
    prompt_tokens = len(tokenize(live_server, prompt="Hello, my name is"))
    assert (completion.usage.completion_tokens, completion.usage.prompt_tokens) == (5, prompt_tokens)
    assert completion.usage.total_tokens == 5 + prompt_tokens
    completion = client.completions.create(model="tiny", prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0)
    assert completion.usage.prompt_tokens == 5 and completion.choices[0].prompt_logprobs is None


def test_no_zero_and_some_logprobs(client):
    # vLLM: tests/entrypoints/openai/completion/test_completion.py::test_no_logprobs (and ::test_zero_logprobs, ::test_some_logprobs)
    kwargs = dict(model="tiny", prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True})
    assert client.completions.create(logprobs=None, **kwargs).choices[0].logprobs is None
    zero = client.completions.create(logprobs=0, **kwargs).choices[0].logprobs
    assert len(zero.token_logprobs) == 5 and all(len(top) == 1 for top in zero.top_logprobs)
    assert [list(top.values())[0] for top in zero.top_logprobs] == pytest.approx(zero.token_logprobs)
    some = client.completions.create(logprobs=5, **kwargs).choices[0].logprobs
    # vLLM allows 5 or 6 (the k best plus the sampled token); greedy picks one of the k best: exactly 5
    assert all(len(top) == 5 for top in some.top_logprobs)
    for token, lp, top in zip(some.tokens, some.token_logprobs, some.top_logprobs, strict=True):
        assert top[token] == pytest.approx(lp) == pytest.approx(max(top.values()))


def test_suffix_null_is_not_set_and_a_suffix_is_refused_by_name(client):
    # vLLM accepts suffix None, which the SDK sends when a caller passes it; nothing here inserts text
    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, suffix=None)
    assert len(completion.choices) == 1 and completion.choices[0].text is not None
    error = bad_request(lambda: client.completions.create(model="tiny", prompt="Hello", max_tokens=3, suffix=" the end"))
    assert error.body["param"] == "suffix" and "suffix" in error.message


def test_too_many_completion_logprobs(live_server, client):
    # vLLM: tests/entrypoints/openai/completion/test_completion.py::test_too_many_completion_logprobs
    error = bad_request(lambda: client.completions.create(model="tiny", prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                                          temperature=0.0, logprobs=21))  # fmt: skip
    assert error.body["param"] == "logprobs"
    # streaming: refused before the stream starts, as a plain 400
    r = post(live_server, COMPLETIONS, {"prompt": [0, 0, 0, 0, 0], "max_tokens": 5, "logprobs": 30, "stream": True})
    refused(r, "logprobs")
    assert client.completions.create(model="tiny", prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0).choices


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, None])
def test_prompt_logprobs_completion(live_server, prompt_logprobs):
    # vLLM: tests/entrypoints/openai/completion/test_completion.py::test_prompt_logprobs_completion
    body = {"prompt": ["A robot may not injure", "My name is"], "max_tokens": 3}
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    r = post(live_server, COMPLETIONS, body)
    if prompt_logprobs is not None and prompt_logprobs < 0:
        refused(r, "prompt_logprobs")
        return
    choices = ok(r)["choices"]
    assert len(choices) == 2
    for choice, prompt in zip(choices, body["prompt"], strict=True):
        if prompt_logprobs is None:
            assert choice["prompt_logprobs"] is None
            continue
        ids = tokenize(live_server, prompt=prompt)
        assert len(choice["prompt_logprobs"]) == len(ids) and choice["prompt_logprobs"][0] is None
        for position, prompt_id in zip(choice["prompt_logprobs"][1:], ids[1:], strict=True):
            assert str(prompt_id) in position and prompt_logprobs <= len(position) <= prompt_logprobs + 1


@pytest.mark.parametrize("logprobs_arg", [1, 0])
@pytest.mark.parametrize("prompt", ["Hello, my name is", [0, 0, 0, 0, 0]], ids=["text", "token-ids"])
def test_echo_logprob_completion(live_server, client, logprobs_arg, prompt):
    # vLLM: tests/entrypoints/openai/completion/test_completion.py::test_echo_logprob_completion
    completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0.0, echo=True,
                                           logprobs=logprobs_arg, extra_body={"ignore_eos": True})  # fmt: skip
    prompt_text = detokenize(live_server, prompt) if isinstance(prompt, list) else prompt
    choice = completion.choices[0]
    assert choice.text.startswith(prompt_text)
    lp = choice.logprobs
    prompt_len = completion.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.text_offset) == len(lp.token_logprobs) == len(lp.top_logprobs) == prompt_len + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for top in lp.top_logprobs[1:]:
        assert max(logprobs_arg, 1) <= len(top) <= logprobs_arg + 1
    # the generated positions start where the echoed prompt's text ends
    assert lp.text_offset[0] == 0 and lp.text_offset[prompt_len] == len(prompt_text)


# ------------------------------------------------------------------ chat_completion/test_chat.py

CHAT_MSG = [{"role": "system", "content": "be helpful"}, {"role": "user", "content": "what is 1+1?"}]


def test_no_zero_and_some_logprobs_chat(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat.py::test_no_logprobs_chat (and ::test_zero_logprobs_chat, ::test_some_logprobs_chat)
    kwargs = dict(model="tiny", messages=CHAT_MSG, max_completion_tokens=5, temperature=0.0)
    assert client.chat.completions.create(logprobs=False, **kwargs).choices[0].logprobs is None
    zero = client.chat.completions.create(logprobs=True, top_logprobs=0, **kwargs).choices[0].logprobs
    assert zero.content and all(e.top_logprobs == [] for e in zero.content)
    some = client.chat.completions.create(logprobs=True, top_logprobs=5, **kwargs).choices[0].logprobs
    for entry in some.content:
        assert len(entry.top_logprobs) == 5
        # greedy: the chosen token is the first of the 5 best
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_top_logprobs_zero_without_logprobs_chat(client):
    # vLLM refuses top_logprobs without logprobs only above 0: 0 asks for nothing
    r = client.chat.completions.create(model="tiny", messages=CHAT_MSG, max_completion_tokens=3, top_logprobs=0)
    assert r.choices[0].logprobs is None
    error = bad_request(lambda: client.chat.completions.create(model="tiny", messages=CHAT_MSG, max_completion_tokens=3,
                                                               top_logprobs=1))  # fmt: skip
    assert error.body["param"] == "top_logprobs"


def test_too_many_chat_logprobs(live_server, client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat.py::test_too_many_chat_logprobs
    r = post(live_server, CHAT, {"messages": CHAT_MSG, "max_completion_tokens": 10, "logprobs": True, "top_logprobs": 21,
                                 "stream": True})  # fmt: skip
    refused(r, "top_logprobs")
    error = bad_request(lambda: client.chat.completions.create(model="tiny", messages=CHAT_MSG, max_completion_tokens=10,
                                                               logprobs=True, top_logprobs=30, stream=False))  # fmt: skip
    assert error.body["param"] == "top_logprobs"
    message = client.chat.completions.create(model="tiny", messages=CHAT_MSG, max_completion_tokens=10).choices[0].message
    assert message.content is not None


CHAT_HISTORY = [
    {"role": "user", "content": "Who won in 2020?"},
    {"role": "assistant", "content": "The Dodgers."},
    {"role": "user", "content": "Where?"},
]


@pytest.mark.parametrize("prompt_logprobs", [1, 0, -1, None])
def test_prompt_logprobs_chat(live_server, client, prompt_logprobs):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat.py::test_prompt_logprobs_chat
    extra = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        error = bad_request(lambda: client.chat.completions.create(model="tiny", messages=CHAT_HISTORY, max_tokens=2,
                                                                   extra_body=extra))  # fmt: skip
        assert error.body["param"] == "prompt_logprobs"
        return
    completion = client.chat.completions.create(model="tiny", messages=CHAT_HISTORY, max_tokens=2, extra_body=extra)
    if prompt_logprobs is None:
        assert completion.prompt_logprobs is None
    else:
        assert len(completion.prompt_logprobs) == completion.usage.prompt_tokens > 0
        assert len(completion.prompt_logprobs) == len(tokenize(live_server, messages=CHAT_HISTORY))


def test_more_than_one_prompt_logprobs_chat(live_server, client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat.py::test_more_than_one_prompt_logprobs_chat
    prompt_ids = tokenize(live_server, messages=CHAT_HISTORY)
    by_k = {k: client.chat.completions.create(model="tiny", messages=CHAT_HISTORY, max_tokens=1,
                                              extra_body={"prompt_logprobs": k}).prompt_logprobs
            for k in (1, 2)}  # fmt: skip
    for k, positions in by_k.items():
        position = positions[3]
        # vLLM's real model predicts its prompt token (k entries); in general: the prompt token and the k best
        assert str(prompt_ids[3]) in position
        assert sum(1 for v in position.values() if v["rank"] <= k) == k
        assert len(position) == k + (position[str(prompt_ids[3])]["rank"] > k)
    best_1 = {i for i, v in by_k[1][3].items() if v["rank"] == 1}
    assert best_1 <= set(by_k[2][3]), "the best token stays listed when more are asked for"


def test_single_chat_session(live_server, client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat.py::test_single_chat_session
    messages = [{"role": "user", "content": "1+1?"}]  # vLLM's system + user turns, shorter: two turns more must fit in 64
    completion = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=5, logprobs=True,
                                                top_logprobs=5, extra_body={"ignore_eos": True})  # fmt: skip
    assert completion.id is not None and len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    prompt_tokens = len(tokenize(live_server, messages=messages))
    assert completion.usage == openai.types.CompletionUsage(completion_tokens=5, prompt_tokens=prompt_tokens,
                                                            total_tokens=prompt_tokens + 5)  # fmt: skip
    assert choice.message.role == "assistant" and choice.message.content is not None
    assert len(choice.logprobs.content) == 5
    messages += [{"role": "assistant", "content": choice.message.content}, {"role": "user", "content": "json"}]
    follow_up = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=5)
    assert follow_up.choices[0].message.content is not None
    assert follow_up.usage.prompt_tokens == len(tokenize(live_server, messages=messages)) > prompt_tokens


def test_long_seed(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat.py::test_long_seed
    for seed in (-(2**63) - 1, 2**63):
        error = bad_request(lambda seed=seed: client.chat.completions.create(
            model="tiny", messages=[{"role": "system", "content": "Be helpful."}], temperature=0, seed=seed))
        assert error.body["param"] == "seed"
    for seed in (-(2**63), 2**63 - 1):  # the int64 bounds themselves are fine
        assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, temperature=0.5, seed=seed).choices  # fmt: skip


def test_complex_message_content(client):
    # vLLM: tests/entrypoints/openai/chat_completion/test_chat.py::test_complex_message_content (and ::test_custom_role's
    # "string and part content are handled the same way"; custom roles themselves are refused here)
    text = "what is 1+1? please provide the result without any other text."
    as_parts = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    parts = client.chat.completions.create(model="tiny", messages=as_parts, temperature=0, seed=0, max_tokens=6)
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], temperature=0,
                                           seed=0, max_tokens=6)  # fmt: skip
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
