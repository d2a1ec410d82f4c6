"""The generated pydantic models: strict validation, absent fields, and agreement with the YAML."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from pydantic import MISSING

import gyrfalcon.generated as g
from gyrfalcon.openapi import bundle

MSG = {"role": "user", "content": "hi"}
MINIMAL = {
    g.GenerateRequest: {"token_ids": [1]},
    g.CompletionRequest: {"prompt": "a"},
    g.ChatCompletionRequest: {"messages": [MSG]},
    g.BatchChatCompletionRequest: {"messages": [[MSG]]},
}


def ok(model: type[pydantic.BaseModel], data: dict[str, Any]) -> pydantic.BaseModel:
    return model.model_validate(data, strict=True)


def rejects(model: type[pydantic.BaseModel], data: dict[str, Any]) -> bool:
    try:
        model.model_validate(data, strict=True)
    except pydantic.ValidationError:
        return True
    return False


def test_every_component_object_has_a_model() -> None:
    schemas = bundle()["components"]["schemas"]
    objects = {name for name, s in schemas.items() if s.get("type") == "object"}
    assert objects <= set(g.__all__)
    for name in g.__all__:
        assert issubclass(getattr(g, name), pydantic.BaseModel)


@pytest.mark.parametrize("model", list(MINIMAL), ids=lambda m: m.__name__)
def test_requests_reject_extra_fields_and_take_nulls(model: type[pydantic.BaseModel]) -> None:
    base = MINIMAL[model]
    ok(model, base)
    assert rejects(model, {**base, "tools": []})
    assert rejects(model, {**base, "extensions": {"anything": 1}})  # no plugin fields in the source documents
    assert rejects(model, {**base, "request_id": ""})
    assert rejects(model, {})
    # null is "not set" on every optional field (the protocol layer drops it)
    assert ok(model, {**base, "stream": None, "model": None, "request_id": None, "extensions": None}).stream is None


def test_generate_request_shapes() -> None:
    req = ok(g.GenerateRequest, {"token_ids": [0, 5], "sampling_params": {"n": 2, "temperature": 0.5, "seed": -(2**63),
             "stop": ["x"], "logit_bias": {"12": -100}, "logprobs": 0, "logprob_token_ids": [3, 4]}})  # fmt: skip
    sp = req.sampling_params
    assert isinstance(sp, g.GenerateSamplingParams) and sp.n == 2 and sp.logit_bias == {"12": -100}
    assert sp.max_tokens is MISSING and sp.prompt_logprobs is MISSING and sp.top_k == -1
    assert req.stream is False and req.stream_options is MISSING and req.model is MISSING
    for bad in ({"token_ids": []}, {"token_ids": [-1]}, {"token_ids": [1.5]}, {"token_ids": ["1"]},
                {"token_ids": [1], "sampling_params": {"seed": 2**63}},
                {"token_ids": [1], "sampling_params": {"temperature": -0.5}},
                {"token_ids": [1], "sampling_params": {"top_p": 0}},
                {"token_ids": [1], "sampling_params": {"top_k": -2}},
                {"token_ids": [1], "sampling_params": {"max_tokens": 0}},
                {"token_ids": [1], "sampling_params": {"stop": [""]}},
                {"token_ids": [1], "sampling_params": {"logit_bias": {"x": 1}}},
                {"token_ids": [1], "sampling_params": {"logit_bias": {"1": 101}}},
                {"token_ids": [1], "sampling_params": {"logprob_token_ids": []}},
                {"token_ids": [1], "sampling_params": {"use_beam_search": False}}):  # fmt: skip
        assert rejects(g.GenerateRequest, bad), bad
    assert ok(g.GenerateRequest, {"token_ids": [1], "sampling_params": {"temperature": 7.5}})  # no upper bound (vLLM)
    assert rejects(g.GenerateRequest, {"token_ids": [1], "sampling_params": {"stop": ["x" * 1025]}})
    assert ok(g.GenerateRequest, {"token_ids": [1], "sampling_params": None}).sampling_params is None
    assert ok(g.GenerateRequest, {"token_ids": [1], "sampling_params": {"n": None, "seed": None}}).sampling_params.n is None


def test_whole_floats_must_become_ints_first() -> None:
    """Strict mode rejects 2.0 for an integer: the protocol layer converts whole floats before validating."""
    assert rejects(g.CompletionRequest, {"prompt": "a", "n": 2.0})
    assert rejects(g.CompletionRequest, {"prompt": "a", "n": True})
    assert rejects(g.CompletionRequest, {"prompt": "a", "n": "2"})
    assert ok(g.CompletionRequest, {"prompt": "a", "n": 2, "temperature": 1}).temperature == 1


@pytest.mark.parametrize("prompt", ["a", ["a", "b"], [1, 2], [[1], [2, 3]]], ids=["str", "strs", "ids", "id-lists"])
def test_completion_prompt_shapes(prompt: Any) -> None:
    assert ok(g.CompletionRequest, {"prompt": prompt}).prompt == prompt


@pytest.mark.parametrize("prompt", ["", [], [""], [[]], [-1], [[1], []], ["a", 1], None], ids=repr)
def test_completion_bad_prompts(prompt: Any) -> None:
    assert rejects(g.CompletionRequest, {"prompt": prompt})


def test_completion_defaults_and_nullables() -> None:
    req = ok(g.CompletionRequest, {"prompt": "a"})
    assert (req.max_tokens, req.logprobs, req.echo, req.n, req.temperature) == (16, None, False, 1, 1.0)
    assert req.seed is MISSING and req.stop is MISSING and req.logprob_token_ids is MISSING
    assert req.model_fields_set == {"prompt"}
    assert "seed" not in req.model_dump() and req.model_dump()["max_tokens"] == 16
    req = ok(g.CompletionRequest, {"prompt": "a", "max_tokens": None, "logprobs": None, "stop": "x"})
    assert req.max_tokens is None and req.logprobs is None and req.stop == "x"
    assert ok(g.CompletionRequest, {"prompt": "a", "stop": ["x", "y"], "max_tokens": 0, "echo": True}).max_tokens == 0
    for bad in ({"stop": ""}, {"stop": [""]}, {"stop": ["x"] * 17}, {"max_tokens": -1}, {"logprobs": -1},
                {"top_logprobs": 1}, {"messages": [MSG]}):  # fmt: skip
        assert rejects(g.CompletionRequest, {"prompt": "a", **bad}), bad
    # OpenAI's "not set" nulls (the protocol layer drops them)
    nulls = ok(g.CompletionRequest, {"prompt": "a", "temperature": None, "seed": None, "stop": None, "user": None,
                                     "n": None, "stream": None, "echo": None})  # fmt: skip
    assert nulls.temperature is None and nulls.seed is None and nulls.stop is None and nulls.n is None


def test_chat_messages() -> None:
    req = ok(g.ChatCompletionRequest, {"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"},
        {"role": "assistant", "content": ""},
    ], "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2})  # fmt: skip
    first, second, _ = req.messages
    assert isinstance(first, g.ChatMessage) and first.name is MISSING
    assert isinstance(second.content[0], g.ChatContentPartText) and second.content[0].text == "hi"
    assert req.max_tokens is MISSING and req.max_completion_tokens == 5 and req.add_generation_prompt is True
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    # which role may carry which field is a runtime rule (message_fields_match_role): the shape alone here
    tools = ok(g.ChatCompletionRequest, {"messages": [
        MSG, {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "think"},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]})  # fmt: skip
    assert tools.messages[1].tool_calls[0].function.name == "f" and tools.messages[2].tool_call_id == "c1"
    for bad in ({"role": "function", "content": "x"}, {"role": "user", "content": []},
                {"role": "user", "content": "x", "name": ""},
                {"role": "user", "content": [{"type": "image_url", "text": "x"}]},
                {"role": "user", "content": [{"type": "text"}]},
                {"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]},
                {"role": "assistant", "tool_calls": [{**call, "type": "custom"}]},
                {"role": "assistant", "tool_calls": [{**call, "function": {"name": "f"}}]},
                {"role": "tool", "content": "x", "tool_call_id": ""}):  # fmt: skip
        assert rejects(g.ChatCompletionRequest, {"messages": [bad]}), bad
    assert rejects(g.ChatCompletionRequest, {"messages": []})
    assert rejects(g.ChatCompletionRequest, {"messages": [MSG], "logprobs": 1})
    assert rejects(g.ChatCompletionRequest, {"messages": [MSG], "echo": 1})


def test_batch_chat_limits() -> None:
    req = ok(g.BatchChatCompletionRequest, {"messages": [[MSG], [MSG, MSG]], "n": 1, "stream": False})
    assert len(req.messages) == 2 and req.use_beam_search is False
    for bad in ({"messages": [[MSG]], "n": 2}, {"messages": [[MSG]], "stream_options": {}},
                {"messages": [[]]}, {"messages": [MSG]}, {"messages": [[MSG]] * 1025},
                {"messages": [[MSG]], "stream": 0}, {"messages": [[MSG]], "use_beam_search": 0}):  # fmt: skip
        assert rejects(g.BatchChatCompletionRequest, bad), bad


def test_batch_chat_stream_and_beam_search_are_plain_booleans() -> None:
    """No ``const: false`` (pydantic's ``Literal[False]`` takes ``0`` even when strict): ``stream: true``
    is refused by the rule ``batch_chat_not_streaming`` and ``use_beam_search: true`` as unsupported."""
    req = ok(g.BatchChatCompletionRequest, {"messages": [[MSG]], "stream": True, "use_beam_search": True})
    assert req.stream is True and req.use_beam_search is True


def test_stream_options_and_extensions() -> None:
    assert ok(g.StreamOptions, {}).include_usage is False
    assert ok(g.StreamOptions, {"include_usage": None}).include_usage is None and rejects(g.StreamOptions, {"x": True})
    assert ok(g.Extensions, {}).model_dump() == {}


def test_response_models_round_trip() -> None:
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    completion = ok(g.CompletionResponse, {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": "x", "logprobs": {"text_offset": [0], "token_logprobs": [None],
                     "tokens": ["x"], "top_logprobs": [None]}, "finish_reason": "length", "stop_reason": None,
                     "token_ids": None, "prompt_token_ids": None, "prompt_logprobs": None}],
        "usage": usage})  # fmt: skip
    dumped = completion.model_dump()
    assert dumped["choices"][0]["token_ids"] is None and dumped["usage"] == usage
    chunk = ok(g.ChatCompletionStreamResponse, {"id": "c", "object": "chat.completion.chunk", "created": 1,
        "model": "m", "choices": [{"index": 1, "delta": {"content": "y"}, "logprobs": None,
                                   "finish_reason": None, "stop_reason": 2}], "usage": None})  # fmt: skip
    assert chunk.model_dump()["choices"][0]["delta"] == {"content": "y"}
    generate = ok(g.GenerateResponse, {"request_id": "r", "model": "m", "created": 1, "usage": usage,
        "choices": [{"index": 0, "token_ids": [4], "text": None, "finish_reason": "stop", "stop_reason": None,
                     "logprobs": {"content": [{"token": "token_id:4", "logprob": -0.5, "top_logprobs": []}]}}],
        "prompt_logprobs": [None, {"7": {"logprob": -0.25, "rank": 3, "decoded_token": "x"}}], "kv_transfer_params": None})  # fmt: skip
    assert generate.prompt_logprobs[0] is None and generate.prompt_logprobs[1]["7"].rank == 3
    assert rejects(g.PromptLogprob, {"logprob": -1.0, "rank": 0, "decoded_token": None})
    assert rejects(g.GenerateChoice, {"index": 0, "token_ids": [], "finish_reason": "done", "stop_reason": None,
                                      "logprobs": None})  # fmt: skip
    error = ok(g.ErrorResponse, {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": 400}})
    assert error.error.param is None
    assert rejects(g.ErrorResponse, {"error": {"message": "m", "type": "t", "code": 400}})
