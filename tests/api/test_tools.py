"""Tool calling through the chat API: required, named and auto tool choice, streamed calls, the tool
round trip as LangChain sends it, and the 400s (the tiny model's template renders no tools: the
parser's instructions stand in)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gyrfalcon.config import Settings
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.conftest import tiny_settings
from tests.helpers import api_client, sse_events, served_app

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                         "additionalProperties": False}}}  # fmt: skip
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """The tiny model with a context long enough for the tool instructions (its template renders no
    tools, and its small vocabulary spends about a token per character)."""
    from gyrfalcon.models.tiny import build_tiny_model

    model = str(build_tiny_model(tmp_path_factory.mktemp("tiny-long"), positions=2048))
    engine = create_transformers_engine(tiny_settings(model, max_model_len=2048, max_num_seqs=4))
    assert engine.wait_ready(120).ready
    settings = Settings(model=model, served_model_name=["tiny"])
    yield api_client(served_app(engine, settings))
    engine.shutdown(0)


def _chat(client, **body):
    return client.simulate_post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, **body})


def _ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json


def _check_call(call: dict, tools: list[dict]) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_")
    tool = next(t["function"] for t in tools if t["function"]["name"] == call["function"]["name"])
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, tool["parameters"])
    return arguments


def test_required_gives_one_valid_call_per_choice(client):
    body = _ok(_chat(client, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False, n=3, seed=2,
                     max_tokens=300))  # fmt: skip
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice in body["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None and len(choice["message"]["tool_calls"]) == 1
        _check_call(choice["message"]["tool_calls"][0], [WEATHER, CLOCK])


def test_a_named_function_is_the_call(client):
    body = _ok(_chat(client, tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                     max_tokens=300, temperature=0))  # fmt: skip
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert set(_check_call(calls[0], [WEATHER])) == {"city", "unit"}


def test_auto_reads_calls_from_the_answer(client):
    """A model that answers with a call in the parser's convention (forced here by a grammar)."""
    grammar = 'start: "Let me check. <tool_call>\\n{\\"name\\": \\"now\\", \\"arguments\\": {}}\\n</tool_call>"'
    body = _ok(_chat(client, tools=[CLOCK], max_tokens=60, structured_outputs={"grammar": grammar}))
    message = body["choices"][0]["message"]
    assert message["content"] == "Let me check." and body["choices"][0]["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("now", "{}")]
    # a call to a tool that was not offered stays text
    stray = 'start: "<tool_call>\\n{\\"name\\": \\"rm\\", \\"arguments\\": {}}\\n</tool_call>"'
    body = _ok(_chat(client, tools=[CLOCK], max_tokens=60, structured_outputs={"grammar": stray}))
    assert body["choices"][0]["message"]["tool_calls"] == [] and "rm" in body["choices"][0]["message"]["content"]


def test_streamed_calls_arrive_whole_with_their_finish(client):
    r = _chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, n=2, seed=5, max_tokens=300,
              stream=True)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    calls: dict[int, list] = {0: [], 1: []}
    finishes: dict[int, list] = {0: [], 1: []}
    for event in events[:-1]:
        assert len(event["choices"]) == 1
        choice = event["choices"][0]
        assert not choice["delta"].get("content"), choice  # nothing of a call leaks out as text
        calls[choice["index"]] += choice["delta"].get("tool_calls", [])
        if choice["finish_reason"]:
            finishes[choice["index"]].append(choice["finish_reason"])
    for index in (0, 1):
        assert finishes[index] == ["tool_calls"] and calls[index]
        assert [c["index"] for c in calls[index]] == list(range(len(calls[index])))
        for call in calls[index]:
            _check_call(call, [WEATHER])


def test_a_tool_round_trip_as_langchain_sends_it(client):
    """call → tool message → answer: the history with the call and its result is rendered and continued."""
    first = _ok(_chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=300,
                      temperature=0))
    call = first["choices"][0]["message"]["tool_calls"][0]
    history = [
        {"role": "system", "content": "You are helpful."},
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 21}'},
    ]
    body = _ok(client.simulate_post("/v1/chat/completions", json={"model": "tiny", "messages": history, "tools": [WEATHER],
                                                                  "max_tokens": 8, "temperature": 0}))  # fmt: skip
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    assert body["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]


def test_none_renders_and_parses_nothing(client):
    with_none = _ok(_chat(client, tools=[WEATHER], tool_choice="none", max_tokens=4, temperature=0))
    without = _ok(_chat(client, max_tokens=4, temperature=0))
    assert with_none["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"]
    assert with_none["choices"][0]["message"]["tool_calls"] == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice.function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "tool_choice": "required"},
         "tools.0.function.parameters"),  # the schema itself is named, before any grammar is built
    ],
)  # fmt: skip
def test_tool_requests_it_cannot_honour_are_a_400_naming_the_field(client, body, param):
    r = _chat(client, max_tokens=4, **body)
    assert r.status_code == 400, r.text
    assert r.json["error"]["param"] == param, r.json
