"""Sampling defaults from the model's generation_config.json for the fields a client leaves unset
(vLLM's ``--generation-config auto``), and the API's own with ``none``."""

from __future__ import annotations

import json
import shutil

import pytest

from gyrfalcon.plugins import plugin_manager
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.conftest import tiny_settings
from tests.helpers import api_client, served_app


MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def model_with_defaults(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gencfg") / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(temperature=0.0, top_k=5, max_new_tokens=3)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


def _client(model_dir, mode):
    settings = tiny_settings(model_dir, served_model_name=["tiny"], generation_config=mode)
    pm = plugin_manager()
    engine = create_transformers_engine(settings, pm)
    assert engine.wait_ready(60).ready
    return engine, api_client(served_app(engine, settings, pm))


def test_the_models_defaults_fill_what_the_client_leaves_unset(model_with_defaults):
    engine, client = _client(model_with_defaults, "auto")
    try:
        assert engine.info().default_sampling == {"temperature": 0.0, "top_k": 5, "max_tokens": 3}
        chat = client.simulate_post("/v1/chat/completions", json={"messages": MESSAGES, "ignore_eos": True}).json
        assert chat["usage"]["completion_tokens"] == 3  # max_new_tokens caps the unset max_tokens
        greedy = client.simulate_post("/v1/completions", json={"prompt": "hi", "max_tokens": 6, "n": 1,
                                                               "ignore_eos": True}).json  # fmt: skip
        again = client.simulate_post("/v1/completions", json={"prompt": "hi", "max_tokens": 6, "ignore_eos": True,
                                                              "temperature": 0}).json  # fmt: skip
        assert greedy["choices"][0]["text"] == again["choices"][0]["text"]  # temperature 0 by default
        asked = client.simulate_post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5,
                                                                   "ignore_eos": True}).json  # fmt: skip
        assert asked["usage"]["completion_tokens"] == 5  # what the client sets wins
    finally:
        engine.shutdown(0)


def test_none_keeps_the_apis_defaults(model_with_defaults):
    engine, client = _client(model_with_defaults, "none")
    try:
        assert engine.info().default_sampling == {}
        chat = client.simulate_post("/v1/chat/completions", json={"messages": MESSAGES, "ignore_eos": True}).json
        assert chat["usage"]["completion_tokens"] + chat["usage"]["prompt_tokens"] == engine.info().max_model_len
    finally:
        engine.shutdown(0)
