"""Bodies as vllm-router 0.1.17 forwards them: it adds SGLang's fields at their defaults, which are
accepted; any other value of them is a 400 naming the field (never a silent drop)."""

from __future__ import annotations

import pytest

#: what vllm-router sent for {"model", "prompt", "max_tokens"} (captured from the router)
COMPLETION = {"model": "tiny", "prompt": "x", "max_tokens": 1, "stream": False, "echo": False, "no_stop_trim": False,
              "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False}  # fmt: skip
#: and for a chat body
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False, "max_tokens": 1,
        "logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
        "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
        "include_reasoning": True}  # fmt: skip


def test_router_bodies_are_served(client):
    r = client.simulate_post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and len(r.json["choices"]) == 1, r.text
    r = client.simulate_post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json["choices"][0]["message"]["role"] == "assistant", r.text


@pytest.mark.parametrize("path,body,field,value", [
    ("/v1/completions", COMPLETION, "no_stop_trim", True),
    ("/v1/completions", COMPLETION, "return_hidden_states", True),
    ("/v1/chat/completions", CHAT, "separate_reasoning", False),
    ("/v1/chat/completions", CHAT, "stream_reasoning", False),
    ("/v1/chat/completions", CHAT, "include_reasoning", False),
])  # fmt: skip
def test_another_value_is_a_400_naming_the_field(client, path, body, field, value):
    r = client.simulate_post(path, json={**body, field: value})
    assert r.status_code == 400 and r.json["error"]["param"] == field, r.text
