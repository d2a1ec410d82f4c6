"""Logprobs through the API on the real tiny engine, checked against a direct forward pass.

The sampled token is forced with ``allowed_token_ids`` (raw logprobs are taken before processors,
so forcing does not change them), which makes the expected set exact: sampled ∪ requested ids.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import chat_delta_text, sse_events

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BATCH = "/v1/chat/completions/batch"
GENERATE = "/inference/v1/generate"
PROMPT = [1, 87, 85, 264, 201, 42, 302, 432, 381]
MSG = [{"role": "user", "content": "Hello there"}]
IDS = [3, 9, 17, 300]
TOL = 1e-4


@pytest.fixture(scope="module")
def forward(tiny_model_dir):
    """``forward(ids) -> [L, V]`` log-softmax of a direct fp32 forward pass of the same model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True, dtype=torch.float32).eval()

    @torch.inference_mode()
    def run(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)

    return run


def token_id(name: str) -> int:
    assert name.startswith("token_id:"), name
    return int(name.removeprefix("token_id:"))


def ok(r):
    assert r.status_code == 200, r.text
    return r.json


def chat_prompt(tiny_engine, messages=MSG) -> list[int]:
    return tiny_engine.tokenize(tiny_engine.apply_chat_template(messages), add_special_tokens=False)


# ------------------------------------------------------------------ completions


def test_completions_forced_token_with_explicit_ids_equals_direct_forward(client, forward):
    forced = 411
    body = ok(client.simulate_post(COMPLETIONS, json={
        "prompt": PROMPT, "max_tokens": 3, "allowed_token_ids": [forced], "logprobs": 5,
        "logprob_token_ids": IDS, "return_tokens_as_token_ids": True, "temperature": 1.0, "seed": 7}))  # fmt: skip
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{forced}"] * 3
    reference = forward(PROMPT + [forced] * 3)
    for p, top in enumerate(lp["top_logprobs"]):
        row = reference[len(PROMPT) - 1 + p]
        assert {token_id(t) for t in top} == {forced, *IDS}  # exactly sampled ∪ requested: no top-5
        for name, value in top.items():
            assert value == pytest.approx(float(row[token_id(name)]), abs=TOL)
        assert lp["token_logprobs"][p] == pytest.approx(float(row[forced]), abs=TOL)


def test_completions_top_k_lists_the_k_best_plus_the_sampled_token(client, forward):
    body = ok(client.simulate_post(COMPLETIONS, json={
        "prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": 3, "logprobs": 3,
        "return_tokens_as_token_ids": True}))  # fmt: skip
    lp = body["choices"][0]["logprobs"]
    sampled = [token_id(t) for t in lp["tokens"]]
    reference = forward(PROMPT + sampled)
    for p, top in enumerate(lp["top_logprobs"]):
        row = reference[len(PROMPT) - 1 + p]
        best = set(row.topk(3).indices.tolist())
        assert {token_id(t) for t in top} == best | {sampled[p]}
        assert all(math.isfinite(v) for v in top.values())


def test_completions_echo_with_max_tokens_zero_returns_prompt_logprobs(client, forward, tiny_engine):
    body = ok(client.simulate_post(COMPLETIONS, json={"prompt": [PROMPT, PROMPT[:5]], "echo": True, "max_tokens": 0,
                                                      "logprobs": 2}))  # fmt: skip
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice, prompt in zip(body["choices"], [PROMPT, PROMPT[:5]]):
        assert choice["text"] == tiny_engine.detokenize(prompt) and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert lp["tokens"] == tiny_engine.token_strings(prompt)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        reference = forward(prompt)
        for p in range(1, len(prompt)):
            assert lp["token_logprobs"][p] == pytest.approx(float(reference[p - 1, prompt[p]]), abs=TOL)
            assert len(lp["top_logprobs"][p]) in (2, 3)
        offsets = [0]
        for token in lp["tokens"][:-1]:
            offsets.append(offsets[-1] + len(token))
        assert lp["text_offset"] == offsets
    assert body["usage"] == {"prompt_tokens": len(PROMPT) + 5, "completion_tokens": 0, "total_tokens": len(PROMPT) + 5}


def test_completions_echo_then_generated_including_the_eos_token(client, forward, tiny_engine):
    eos = tiny_engine.info().eos_token_ids[0]
    body = ok(client.simulate_post(COMPLETIONS, json={"prompt": PROMPT, "echo": True, "max_tokens": 4,
                                                      "logprobs": 1, "allowed_token_ids": [eos]}))  # fmt: skip
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == tiny_engine.detokenize(PROMPT)  # eos text not shown
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT) + 1 and lp["tokens"][-1] == tiny_engine.token_strings([eos])[0]
    reference = forward(PROMPT)
    assert lp["token_logprobs"][-1] == pytest.approx(float(reference[-1, eos]), abs=TOL)


def test_completions_prompt_logprobs_field(client, forward):
    body = ok(client.simulate_post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}))
    choice = body["choices"][0]
    assert choice["logprobs"] is None
    prompt_lp = choice["prompt_logprobs"]
    assert len(prompt_lp) == len(PROMPT) and prompt_lp[0] is None
    reference = forward(PROMPT)
    for p in range(1, len(PROMPT)):
        entry = prompt_lp[p]
        best = set(reference[p - 1].topk(2).indices.tolist())
        assert {int(k) for k in entry} == best | {PROMPT[p]}
        for key, value in entry.items():
            assert value["logprob"] == pytest.approx(float(reference[p - 1, int(key)]), abs=TOL)


def test_completions_stream_deltas_union_of_ids_and_continuing_offsets(client):
    request = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0.0, "logprobs": 2, "echo": True,
               "logprob_token_ids": IDS, "ignore_eos": True}  # fmt: skip
    whole = ok(client.simulate_post(COMPLETIONS, json=request))["choices"][0]["logprobs"]
    r = client.simulate_post(COMPLETIONS, json={**request, "stream": True})
    assert r.status_code == 200
    joined = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for event in sse_events(r.text)[:-1]:
        for choice in event["choices"]:
            if choice["logprobs"] is not None:
                for key in joined:
                    joined[key] += choice["logprobs"][key]
    assert joined["tokens"] == whole["tokens"] and joined["text_offset"] == whole["text_offset"]
    assert joined["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=TOL)
    generated = joined["top_logprobs"][len(PROMPT):]
    assert len(generated) == 5
    for top, token in zip(generated, joined["tokens"][len(PROMPT):]):
        assert token in top and len(top) >= len(IDS)


# ------------------------------------------------------------------ chat and batch chat


def test_chat_top_logprobs_and_bytes(client, forward, tiny_engine):
    body = ok(client.simulate_post(CHAT, json={"messages": MSG, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True,
                                               "logprobs": True, "top_logprobs": 2}))  # fmt: skip
    content = body["choices"][0]["logprobs"]["content"]
    prompt = chat_prompt(tiny_engine)
    generated = tiny_engine.tokenize(body["choices"][0]["message"]["content"], add_special_tokens=False)
    assert len(content) == 3
    reference = forward(prompt + [tiny_engine_token(tiny_engine, e) for e in content])
    for p, entry in enumerate(content):
        row = reference[len(prompt) - 1 + p]
        assert len(entry["top_logprobs"]) == 2  # chat: exactly the k most likely
        assert entry["logprob"] == pytest.approx(float(row.max()), abs=TOL)  # greedy: the best one
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(row.topk(2).values.tolist(), abs=TOL)
        assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"]
    assert generated  # the content decodes to tokens again


def tiny_engine_token(engine, entry) -> int:
    """The id of a chat logprob entry's token (greedy test: tokens are whole strings here)."""
    (token,) = [t for t in range(engine.info().vocab_size) if engine.token_strings([t])[0] == entry["token"]][:1]
    return token


def test_chat_explicit_ids_forced_token_and_partial_character_bytes(client, forward, tiny_engine):
    forced = 130  # a byte-level token holding the first byte of a two-byte character
    body = ok(client.simulate_post(CHAT, json={"messages": MSG, "max_tokens": 2, "logprobs": True, "top_logprobs": 5,
                                               "logprob_token_ids": IDS, "allowed_token_ids": [forced]}))  # fmt: skip
    content = body["choices"][0]["logprobs"]["content"]
    reference = forward(chat_prompt(tiny_engine) + [forced] * 2)
    offset = len(chat_prompt(tiny_engine)) - 1
    for p, entry in enumerate(content):
        assert entry["bytes"] == [0xC3] and entry["token"] == "\ufffd"
        row = reference[offset + p]
        assert entry["logprob"] == pytest.approx(float(row[forced]), abs=TOL)
        assert len(entry["top_logprobs"]) == len(IDS) + 1
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx([float(row[i]) for i in [forced, *IDS]], abs=TOL)


def test_chat_return_tokens_as_token_ids_everywhere_and_stream_union(client):
    request = {"messages": MSG, "max_tokens": 4, "logprobs": True, "logprob_token_ids": IDS, "temperature": 1.0,
               "seed": 5, "return_tokens_as_token_ids": True, "ignore_eos": True}  # fmt: skip
    r = client.simulate_post(CHAT, json={**request, "stream": True})
    assert r.status_code == 200
    entries = []
    text = ""
    for event in sse_events(r.text)[:-1]:
        for choice in event["choices"]:
            text += chat_delta_text(choice)
            if choice["logprobs"] is not None:
                entries += choice["logprobs"]["content"]
    assert len(entries) == 4
    for entry in entries:
        sampled = token_id(entry["token"])
        assert {token_id(t["token"]) for t in entry["top_logprobs"]} == {sampled, *IDS}
    whole = ok(client.simulate_post(CHAT, json=request))["choices"][0]
    assert [e["token"] for e in whole["logprobs"]["content"]] == [e["token"] for e in entries]
    assert whole["message"]["content"] == text


def test_batch_chat_per_conversation(client, forward, tiny_engine):
    conversations = [MSG, [{"role": "user", "content": "What is the capital of France?"}]]
    forced = 411
    body = ok(client.simulate_post(BATCH, json={"messages": conversations, "max_tokens": 2, "logprobs": True,
                                                "logprob_token_ids": IDS, "allowed_token_ids": [forced],
                                                "return_tokens_as_token_ids": True, "prompt_logprobs": 1}))  # fmt: skip
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice, messages in zip(body["choices"], conversations):
        prompt = chat_prompt(tiny_engine, messages)
        reference = forward(prompt + [forced] * 2)
        for p, entry in enumerate(choice["logprobs"]["content"]):
            row = reference[len(prompt) - 1 + p]
            assert entry["token"] == f"token_id:{forced}"
            tops = {token_id(t["token"]): t["logprob"] for t in entry["top_logprobs"]}
            assert set(tops) == {forced, *IDS}
            for t, value in tops.items():
                assert value == pytest.approx(float(row[t]), abs=TOL)
        assert len(choice["prompt_logprobs"]) == len(prompt) and choice["prompt_logprobs"][0] is None


def test_chat_prompt_logprobs_on_the_response(client, tiny_engine, forward):
    body = ok(client.simulate_post(CHAT, json={"messages": MSG, "max_tokens": 1, "prompt_logprobs": 0}))
    prompt = chat_prompt(tiny_engine)
    reference = forward(prompt)
    assert body["choices"][0]["logprobs"] is None
    entries = body["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for p in range(1, len(prompt)):
        (key,) = entries[p]
        assert int(key) == prompt[p]
        assert entries[p][key]["logprob"] == pytest.approx(float(reference[p - 1, prompt[p]]), abs=TOL)


# ------------------------------------------------------------------ generate


def test_generate_logprobs_prompt_logprobs_and_ids(client, forward):
    forced = 411
    body = ok(client.simulate_post(GENERATE, json={"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 2, "logprobs": len(IDS), "prompt_logprobs": 1, "logprob_token_ids": IDS,
        "allowed_token_ids": [forced]}}))  # fmt: skip
    reference = forward(PROMPT + [forced] * 2)
    choice = body["choices"][0]
    assert choice["token_ids"] == [forced, forced]
    for p, entry in enumerate(choice["logprobs"]["content"]):
        row = reference[len(PROMPT) - 1 + p]
        assert entry["token"] == f"token_id:{forced}"
        assert entry["logprob"] == pytest.approx(float(row[forced]), abs=TOL)
        assert {token_id(t["token"]) for t in entry["top_logprobs"]} == {forced, *IDS}
    assert_vllm_prompt_logprobs(body["prompt_logprobs"], reference, decoded=True)


def assert_vllm_prompt_logprobs(prompt, reference, decoded):
    """vLLM's list: null, then by token id the prompt token and the most likely one, each with its
    logprob, its rank in the whole vocabulary and (when decoded) its text."""
    assert len(prompt) == len(PROMPT) and prompt[0] is None
    for p in range(1, len(PROMPT)):
        row = reference[p - 1]
        best = int(row.argmax())
        assert list(prompt[p])[0] == str(PROMPT[p])  # the prompt token first, as vLLM lists it
        assert set(prompt[p]) == {str(PROMPT[p]), str(best)}
        for key, entry in prompt[p].items():
            assert entry["logprob"] == pytest.approx(float(row[int(key)]), abs=TOL)
            assert entry["rank"] == int((row >= row[int(key)]).sum())
            assert (entry["decoded_token"] is not None) is decoded
        assert prompt[p][str(best)]["rank"] == 1


def test_generate_detokenize_false_gives_ids_only(client, forward):
    request = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3, "prompt_logprobs": 1, "seed": 4}}
    with_text = ok(client.simulate_post(GENERATE, json=request))
    request["sampling_params"]["detokenize"] = False
    ids_only = ok(client.simulate_post(GENERATE, json=request))
    assert ids_only["choices"][0]["token_ids"] == with_text["choices"][0]["token_ids"]
    assert ids_only["choices"][0]["text"] is None and isinstance(with_text["choices"][0]["text"], str)
    assert_vllm_prompt_logprobs(ids_only["prompt_logprobs"], forward(PROMPT), decoded=False)


def test_no_logprobs_unless_asked(client):
    for path, body in [(COMPLETIONS, {"prompt": "hi", "max_tokens": 2}), (CHAT, {"messages": MSG, "max_tokens": 2}),
                       (GENERATE, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}})]:  # fmt: skip
        out = ok(client.simulate_post(path, json=body))
        assert out["choices"][0]["logprobs"] is None
        assert out["choices"][0].get("prompt_logprobs") is None  # vLLM serialises it as null


def test_every_choice_has_its_own_logprobs_and_prefill_only_streams(client, forward, tiny_engine):
    body = ok(client.simulate_post(COMPLETIONS, json={"prompt": [PROMPT, PROMPT[:4]], "n": 3, "max_tokens": 2, "seed": 1,
                                                      "logprobs": 1, "return_tokens_as_token_ids": True}))  # fmt: skip
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for choice in body["choices"]:
        prompt = PROMPT if choice["index"] < 3 else PROMPT[:4]
        tokens = [token_id(t) for t in choice["logprobs"]["tokens"]]
        reference = forward(prompt + tokens)
        for p, value in enumerate(choice["logprobs"]["token_logprobs"]):
            assert value == pytest.approx(float(reference[len(prompt) - 1 + p, tokens[p]]), abs=TOL)
    # echo + max_tokens 0 + logprobs, streamed: one chunk per choice with the prompt's logprobs
    r = client.simulate_post(COMPLETIONS, json={"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 0,
                                                "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    events = sse_events(r.text)
    choices = [c for e in events[:-1] for c in e["choices"]]
    assert len(choices) == 1 and choices[0]["finish_reason"] == "length"
    assert choices[0]["text"] == tiny_engine.detokenize(PROMPT)
    assert len(choices[0]["logprobs"]["tokens"]) == len(PROMPT)
    assert events[-2]["usage"]["completion_tokens"] == 0
