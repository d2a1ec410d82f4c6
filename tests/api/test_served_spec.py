"""The served spec follows the model: a model without a chat template serves no chat."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gyrfalcon.plugins import plugin_manager
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.conftest import tiny_settings
from tests.helpers import api_client, served_app


NAMED_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] }}"
    "{% if message.get('name') %}{{ ' ' + message['name'] }}{% endif %}"
    "{{ '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def client_for_template(tiny_model_dir, folder: Path, template: str | None):
    """An app on a copy of the tiny model whose chat template is ``template`` (None: no template)."""
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    settings = tiny_settings(str(folder), served_model_name=["base"])
    pm = plugin_manager()
    engine = create_transformers_engine(settings, pm)
    assert engine.wait_ready(60).ready
    return engine, api_client(served_app(engine, settings, pm))


@pytest.fixture(scope="module")
def base_model_client(tiny_model_dir, tmp_path_factory):
    engine, client = client_for_template(tiny_model_dir, Path(tmp_path_factory.mktemp("base")) / "model", None)
    yield client
    engine.shutdown(grace=1.0)


@pytest.fixture(scope="module")
def named_template_client(tiny_model_dir, tmp_path_factory):
    engine, client = client_for_template(tiny_model_dir, Path(tmp_path_factory.mktemp("named")) / "model", NAMED_TEMPLATE)
    yield client
    engine.shutdown(grace=1.0)


def test_message_name_is_honoured_or_refused(client, named_template_client):
    named = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi", "name": "ann"}]
    r = client.simulate_post("/v1/chat/completions", json={"messages": named, "max_tokens": 1})
    assert r.status_code == 400 and r.json["error"]["param"] == "messages.1.name"  # ChatML ignores names
    assert client.simulate_get("/openapi.json").json["components"]["schemas"]["ChatMessage"]["properties"]["name"]["type"] == "null"
    anonymous = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    with_name = named_template_client.simulate_post("/tokenize", json={"messages": named}).json
    without = named_template_client.simulate_post("/tokenize", json={"messages": anonymous}).json
    assert with_name["count"] > without["count"]  # the name is rendered
    r = named_template_client.simulate_post("/v1/chat/completions", json={"messages": named, "max_tokens": 1})
    assert r.status_code == 200 and r.json["usage"]["prompt_tokens"] == with_name["count"]
    spec = named_template_client.simulate_get("/openapi.json").json
    assert spec["components"]["schemas"]["ChatMessage"]["properties"]["name"].get("type") == ["string", "null"]


def test_no_chat_template_means_no_chat_in_the_spec(base_model_client):
    r = base_model_client.simulate_get("/openapi.json")
    assert r.status_code == 200, r.text
    spec = r.json
    assert "/v1/chat/completions" not in spec["paths"] and "/v1/chat/completions/batch" not in spec["paths"]
    assert "/v1/completions" in spec["paths"] and spec["x-limits"]["chat"] is None
    chat = base_model_client.simulate_post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 400 and chat.json["error"]["param"] == "messages"
    assert base_model_client.simulate_post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_chat_overhead_is_published(client):
    chat = client.simulate_get("/openapi.json").json["x-limits"]["chat"]
    assert chat["per_message"] >= 1 and chat["fixed"] >= 0


def test_an_extension_nobody_honours_must_be_absent(tiny_engine):
    from gyrfalcon.api.spec import bounded_extensions

    info = tiny_engine.info()
    fragment = {"type": "integer", "x-token-id": True}
    bounded = bounded_extensions({"orphan": fragment, "ids": {"type": "array", "items": fragment}}, info)
    assert bounded["orphan"]["not"] == {}
    assert "ids" not in info.capabilities and bounded["ids"]["not"] == {}


def test_no_chat_template_means_no_responses_api_in_the_spec(base_model_client):
    """The Responses API renders its input as a conversation: without a chat template it is refused
    loudly, and the served spec does not offer it (a fuzzer's valid request must be servable)."""
    spec = base_model_client.simulate_get("/openapi.json").json
    assert "/v1/responses" not in spec["paths"]
    r = base_model_client.simulate_post("/v1/responses", json={"input": "x", "max_output_tokens": 16})
    assert r.status_code == 400 and r.json["error"]["param"] == "input", r.text


def test_the_composition_root_builds_the_translator_spec_and_store_at_start_up(tiny_engine, tiny_model_dir, monkeypatch):
    """An app built through ``compose.app`` over a ready engine has its translator, served spec and
    stored responses before its first request: no request pays for them, and a worker freezes them
    with the rest of what it holds (``gunicorn_conf.post_worker_init``)."""
    import gyrfalcon.api.context as context
    from gyrfalcon.config import Settings

    client = api_client(served_app(tiny_engine, Settings(model=tiny_model_dir, served_model_name=["tiny"])))

    def built_late(*args, **kwargs):
        raise AssertionError("built on a request")

    monkeypatch.setattr(context, "Translator", built_late)
    monkeypatch.setattr(context, "deployment_spec", built_late)
    monkeypatch.setattr(context, "ResponseStore", built_late)
    assert client.simulate_get("/openapi.json").status_code == 200
    r = client.simulate_post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200, r.text
    r = client.simulate_post("/v1/responses", json={"input": "hi", "max_output_tokens": 1})
    assert r.status_code == 200, r.text
    assert client.simulate_get(f"/v1/responses/{r.json['id']}").status_code == 200
