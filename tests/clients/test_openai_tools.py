"""Tools through the official ``openai`` package, against a live server: a required call, a streamed
call, and the round trip an agent makes (the SDK's own message objects sent back)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.live_server import start_server, stop_server

pytestmark = pytest.mark.live

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
    "additionalProperties": False}}}  # fmt: skip


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """A server on a tiny model with room for the tool instructions (its template renders no tools)."""
    from gyrfalcon.models.tiny import build_tiny_model

    model = str(build_tiny_model(tmp_path_factory.mktemp("tiny-tools"), positions=2048))
    server = start_server(["--model", model, "--max-model-len", "2048", "--max-num-seqs", "4", "--num-threads", "1",
                           "--served-model-name", "tiny"], str(tmp_path_factory.mktemp("tools-live") / "server.log"))  # fmt: skip
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stop_server(server)


def test_required_call_round_trip(client):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=300, temperature=0)  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]  # fmt: skip
    answer = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=5, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


def test_streamed_named_call(client):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Oslo?"}], tools=[WEATHER],
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            max_tokens=300, seed=4, stream=True)  # fmt: skip
    calls, finishes = [], []
    for chunk in stream:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert finishes == ["tool_calls"] and [c.function.name for c in calls] == ["get_weather"]
    assert set(json.loads(calls[0].function.arguments)) == {"city"}
