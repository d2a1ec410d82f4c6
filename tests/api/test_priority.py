"""``priority`` on a server started with ``--scheduling-policy priority``: accepted on every endpoint
vLLM has it (the scheduler's order is tested in ``tests/unit``); refused on an fcfs server
(``test_invalid_requests``)."""

from __future__ import annotations

import pytest

from gyrfalcon.plugins import plugin_manager
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.conftest import tiny_settings
from tests.helpers import api_client, served_app


@pytest.fixture(scope="module")
def priority_client(tiny_model_dir):
    settings = tiny_settings(tiny_model_dir, served_model_name=["tiny"], scheduling_policy="priority")
    pm = plugin_manager()
    engine = create_transformers_engine(settings, pm)
    assert engine.wait_ready(60).ready
    yield api_client(served_app(engine, settings, pm))
    engine.shutdown(0)


@pytest.mark.parametrize("path, body", [
    ("/inference/v1/generate", {"token_ids": [1, 5, 9], "priority": -4, "sampling_params": {"max_tokens": 2}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "priority": 10}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -1}),
])  # fmt: skip
def test_a_priority_server_honours_priority(priority_client, path, body):
    response = priority_client.simulate_post(path, json=body)
    assert response.status_code == 200, response.text
    assert len(response.json["choices"]) == 1
