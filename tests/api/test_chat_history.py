"""Conversations as agents and the SDK send them back: tool turns, assistant tool calls, null
content, reasoning_content — rendered by the model's template, or refused naming the field the
template would ignore — and chat ``echo``."""

from __future__ import annotations

import json
import shutil

import pytest

from gyrfalcon.models.tiny import CHATML_TEMPLATE
from gyrfalcon.plugins import plugin_manager
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.conftest import tiny_settings
from tests.helpers import api_client, chat_delta_text, sse_events, stream_by_choice, served_app


CHAT = "/v1/chat/completions"
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"city": "Oslo"}'}}
HISTORY = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "I should look it up"},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]
#: ChatML that also renders an assistant turn's tool calls (as Qwen-style templates do)
TOOL_TEMPLATE = CHATML_TEMPLATE.replace(
    "message['content'] + '<|im_end|>'",
    "message['content'] + ((message.tool_calls | map(attribute='function') | list | tojson) if message.tool_calls else '')"
    " + '<|im_end|>'",
)


def prompt_ids(client, messages, **extra):
    body = {"messages": messages, "max_tokens": 1, "return_token_ids": True, **extra}
    r = client.simulate_post(CHAT, json=body)
    assert r.status_code == 200, r.text
    return r.json["prompt_token_ids"]


def test_tool_turns_and_null_content_render_with_the_template(client, tiny_engine):
    history = [HISTORY[0], {"role": "assistant", "content": None}, HISTORY[2]]
    # the tiny model's ChatML: role and content of every turn, a null content as nothing
    text = "".join(f"<|im_start|>{m['role']}\n{m['content'] or ''}<|im_end|>\n" for m in history) + "<|im_start|>assistant\n"
    assert prompt_ids(client, history) == tiny_engine.tokenize(text, add_special_tokens=False)


def test_reasoning_content_is_the_templates_to_use_or_leave(client):
    plain = [HISTORY[0], {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    with_reasoning = [plain[0], {**plain[1], "reasoning_content": "thinking"}, plain[2]]
    assert prompt_ids(client, with_reasoning) == prompt_ids(client, plain)  # this template leaves past reasoning out


def test_tool_calls_a_template_ignores_are_refused_and_the_served_spec_says_so(client):
    r = client.simulate_post(CHAT, json={"messages": HISTORY, "max_tokens": 1})
    assert r.status_code == 400 and r.json["error"]["param"] == "messages.1.tool_calls", r.text
    message = client.simulate_get("/openapi.json").json["components"]["schemas"]["ChatMessage"]["properties"]
    assert message["tool_calls"]["anyOf"] == [{"type": "null"}, {"type": "array", "maxItems": 0}]
    assert "tool" in message["role"]["enum"]
    empty = [HISTORY[0], {"role": "assistant", "content": "ok", "tool_calls": []}, {"role": "user", "content": "x"}]
    assert client.simulate_post(CHAT, json={"messages": empty, "max_tokens": 1}).status_code == 200  # nothing asked


def test_deeply_nested_tool_call_arguments_are_a_400(tool_client):
    _, client = tool_client
    deep = {**CALL, "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}
    messages = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [deep]}, {"role": "user", "content": "x"}]
    r = client.simulate_post(CHAT, json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 400 and r.json["error"]["param"] == "messages.1.tool_calls.0.function.arguments", r.text


def test_tool_turns_a_template_drops_are_refused(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHATML_TEMPLATE.replace("{% for message in messages %}",
                                                      "{% for message in messages if message.role != 'tool' %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    settings = tiny_settings(str(folder), served_model_name=["tiny"])
    pm = plugin_manager()
    engine = create_transformers_engine(settings, pm)
    try:
        assert engine.wait_ready(60).ready
        client = api_client(served_app(engine, settings, pm))
        assert "tool" not in client.simulate_get("/openapi.json").json["components"]["schemas"]["ChatMessage"][
            "properties"]["role"]["enum"]  # fmt: skip
        r = client.simulate_post(CHAT, json={"messages": [HISTORY[0], HISTORY[2]], "max_tokens": 1})
        assert r.status_code == 400 and r.json["error"]["param"] == "messages.1.role", r.text
    finally:
        engine.shutdown(0)


@pytest.fixture(scope="module")
def tool_client(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools") / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    settings = tiny_settings(str(folder), served_model_name=["tiny"])
    pm = plugin_manager()
    engine = create_transformers_engine(settings, pm)
    assert engine.wait_ready(60).ready
    yield engine, api_client(served_app(engine, settings, pm))
    engine.shutdown(0)


def test_a_template_that_renders_tool_calls_gets_them_parsed(tool_client):
    engine, client = tool_client
    message = client.simulate_get("/openapi.json").json["components"]["schemas"]["ChatMessage"]["properties"]
    assert message["tool_calls"]["type"] == ["array", "null"]
    ids = prompt_ids(client, HISTORY)
    text = engine.detokenize(ids)
    # the arguments reached the template as an object (vLLM parses them), not as a JSON string
    assert '[{"name": "lookup", "arguments": {"city": "Oslo"}}]' in text and "sunny" in text, text


def test_chat_echo_puts_the_last_assistant_turn_first(client):
    start = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one two"}]
    body = {"messages": start, "max_tokens": 3, "n": 2, "temperature": 1, "seed": 3, "echo": True,
            "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    r = client.simulate_post(CHAT, json=body)
    assert r.status_code == 200, r.text
    plain = client.simulate_post(CHAT, json={**body, "echo": False}).json
    for echoed, generated in zip(r.json["choices"], plain["choices"]):
        assert echoed["message"]["content"] == "one two" + generated["message"]["content"]
    streamed = stream_by_choice(sse_events(client.simulate_post(CHAT, json={**body, "stream": True}).text), chat_delta_text)
    assert [streamed[i]["text"] for i in (0, 1)] == [c["message"]["content"] for c in r.json["choices"]]
    after_user = client.simulate_post(CHAT, json={"messages": start[:1], "max_tokens": 2, "echo": True, "seed": 1}).json
    alone = client.simulate_post(CHAT, json={"messages": start[:1], "max_tokens": 2, "seed": 1}).json
    assert after_user["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
