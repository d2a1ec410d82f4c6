"""The Responses API through the official ``openai`` package, against a live server: create, stream,
parse, the stored state, and a function call's round trip (through ``previous_response_id`` and
through explicit items)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.live_server import start_server, stop_server

pytestmark = pytest.mark.live

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
    "additionalProperties": False}}  # fmt: skip


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """A server on a tiny model with room for the tool instructions, its store in a fresh folder."""
    from gyrfalcon.models.tiny import build_tiny_model

    model = str(build_tiny_model(tmp_path_factory.mktemp("tiny-responses"), positions=2048))
    cache = str(tmp_path_factory.mktemp("responses-cache"))
    server = start_server(["--model", model, "--max-model-len", "2048", "--max-num-seqs", "4", "--num-threads", "1",
                           "--served-model-name", "tiny", "--cache-dir", cache, "--api-workers", "2"],
                          str(tmp_path_factory.mktemp("responses-live") / "server.log"))  # fmt: skip
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stop_server(server)


def test_create_then_the_stored_state(client):
    r = client.responses.create(model="tiny", input="Say hi.", instructions="Be brief.", max_output_tokens=6,
                                extra_body={"ignore_eos": True, "seed": 2})  # fmt: skip
    assert r.id.startswith("resp_") and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
    assert (r.usage.output_tokens, r.usage.total_tokens) == (6, r.usage.input_tokens + 6) and r.instructions == "Be brief."
    # every API worker reads the same store (two workers here): the stored response, its input items
    for _ in range(4):
        again = client.responses.retrieve(r.id)
        assert again.id == r.id and again.output_text == r.output_text
    items = client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Say hi.")]
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_stream_is_the_events_in_order_and_their_text_the_deltas(client):
    with client.responses.stream(model="tiny", input="Count.", max_output_tokens=8,
                                 extra_body={"ignore_eos": True, "seed": 5}) as stream:
        events = list(stream)
    final = events[-1].response  # cut by max_output_tokens: response.incomplete (the SDK's final is for completed)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output[0].content[0].text and final.usage.output_tokens == 8
    assert client.responses.retrieve(final.id).output_text == deltas  # streamed answers are stored too
    with client.responses.stream(model="tiny", input="Is it?", max_output_tokens=40, temperature=0.5,
                                 text={"format": {"type": "json_object"}}, extra_body={"seed": 1}) as stream:
        done = stream.get_final_response()
    assert done.status == "completed" and isinstance(json.loads(done.output_text), dict)


def test_logprobs_of_the_output_text(client):
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=4, top_logprobs=2,
                                include=["message.output_text.logprobs"], extra_body={"ignore_eos": True, "seed": 1})  # fmt: skip
    entries = r.output[0].content[0].logprobs
    assert len(entries) == 4 and all(len(e.top_logprobs) == 2 for e in entries)
    assert "".join(e.token for e in entries) == r.output_text


def test_parse_with_a_pydantic_model(client):
    from typing import Literal

    import pydantic

    class Verdict(pydantic.BaseModel):
        answer: Literal["yes", "no"]
        confident: bool

    r = client.responses.parse(model="tiny", input="Is it?", text_format=Verdict, max_output_tokens=40,
                               temperature=0.5, extra_body={"seed": 1})  # fmt: skip
    assert r.status == "completed" and isinstance(r.output_parsed, Verdict)


def test_function_call_round_trip_through_previous_response_id_and_explicit_items(client):
    first = client.responses.create(model="tiny", input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=300, temperature=0)  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments)["city"], str)
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}
    chained = client.responses.create(model="tiny", previous_response_id=first.id, input=[result], tools=[WEATHER],
                                      max_output_tokens=5, temperature=0)  # fmt: skip
    explicit = client.responses.create(model="tiny", tools=[WEATHER], max_output_tokens=5, temperature=0,
                                       input=[{"role": "user", "content": "Weather in Oslo?"}, *first.output, result])  # fmt: skip
    # the same conversation either way: the same prompt, so the same greedy answer
    assert chained.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens
    assert chained.output_text == explicit.output_text


def test_refusals_name_their_field(client):
    cases = [({"background": True, "store": False}, "background"), ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
             ({"truncation": "auto"}, "truncation"), ({"reasoning": {"effort": "low"}}, "reasoning"),
             ({"include": ["reasoning.encrypted_content"]}, "include.0"),
             ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
             ({"max_output_tokens": 5000}, "max_output_tokens")]  # fmt: skip
    for extra, param in cases:
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as refused:
            client.responses.create(model="tiny", input="x", **extra)
        assert refused.value.body["param"] == param, (extra, refused.value.body)


def test_a_streamed_function_call_is_its_item_and_arguments_events(client):
    stream = client.responses.create(model="tiny", input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=300, temperature=0, stream=True)  # fmt: skip
    events = list(stream)
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds  # the answer is only the call
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.arguments == ""
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert isinstance(json.loads(done.arguments)["city"], str)
    assert kinds[-1] == "response.completed" and events[-1].response.output[0].arguments == done.arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_background_response_runs_on_and_a_cancel_from_any_worker_stops_it(client):
    import time

    done = client.responses.create(model="tiny", input="Hi", max_output_tokens=4, background=True,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    assert done.status == "in_progress" and done.background is True
    deadline = time.monotonic() + 60
    while client.responses.retrieve(done.id).status == "in_progress" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.responses.retrieve(done.id).usage.output_tokens == 4
    long = client.responses.create(model="tiny", input="Hi", max_output_tokens=1500, background=True,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    # two API workers: the cancel may reach the one not running it, which tells it through the store
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    time.sleep(3)
    assert client.responses.retrieve(long.id).status == "cancelled"
    import urllib.request

    url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/metrics"
    metrics = urllib.request.urlopen(url, timeout=30).read().decode()  # the engine aborted it
    aborted = [line for line in metrics.splitlines() if line.startswith("gyrfalcon_requests_aborted_total ")]
    assert aborted and float(aborted[0].split()[-1]) >= 1
