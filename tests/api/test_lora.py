"""LoRA adapters over HTTP (``--enable-lora``): a request names an adapter as its ``model``;
``/v1/models`` lists adapters with their parent; vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` change what serves, refusing what cannot serve with a 400 naming the
field (404 for an adapter that is not there); without the flag the routes are not served."""

from __future__ import annotations

import shutil

import pytest

from gyrfalcon.engine_api.types import EngineRequest, SamplingParams
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.conftest import tiny_settings
from tests.helpers import api_client, served_app
from tests.unit.test_lora import _safetensors, write_adapter


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    first, second = write_adapter(tiny_model_dir, folder / "first", seed=1), write_adapter(tiny_model_dir, folder / "second", seed=2)
    settings = tiny_settings(tiny_model_dir, enable_lora=True, lora_modules=[f"first={first}"], max_loras=2,
                             served_model_name=["tiny"])  # fmt: skip
    engine = create_transformers_engine(settings)
    assert engine.wait_ready(60).ready, engine.health().message
    yield engine, api_client(served_app(engine, settings)), first, second
    engine.shutdown(0)


BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _text(engine, lora: str | None) -> str:
    request = EngineRequest(f"direct-{lora}", BODY["prompt"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            lora_name=lora)  # fmt: skip
    return list(engine.submit(request))[-1].outputs[0].text


def test_a_request_names_its_adapter_as_its_model(served):
    engine, client, first, _ = served
    cards = {card["id"]: card for card in client.simulate_get("/v1/models").json["data"]}
    assert cards["first"]["parent"] == "tiny" and cards["first"]["root"] == str(first) and cards["tiny"]["parent"] is None
    adapted = client.simulate_post("/v1/completions", json={**BODY, "model": "first"})
    base = client.simulate_post("/v1/completions", json={**BODY, "model": "tiny"})
    assert adapted.status_code == base.status_code == 200
    assert adapted.json["model"] == "first"
    assert adapted.json["choices"][0]["text"] == _text(engine, "first") != base.json["choices"][0]["text"]
    chat = client.simulate_post("/v1/chat/completions", json={"model": "first", "max_tokens": 4,
                                                               "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json["model"] == "first"
    missing = client.simulate_post("/v1/completions", json={**BODY, "model": "nobody"})
    assert missing.status_code == 404 and missing.json["error"]["param"] == "model"
    metrics = client.simulate_get("/metrics").text
    assert 'gyrfalcon:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
    spec = client.simulate_get("/openapi.json").json
    assert "/v1/load_lora_adapter" in spec["paths"]
    assert "enum" not in spec["components"]["schemas"]["CompletionRequest"]["properties"]["model"]  # adapters come and go


def test_what_is_answered_without_the_engine_knows_the_adapters_too(served):
    """Tokenizing and an echo of the prompt alone never reach the engine: the API asks it which
    adapters it holds, so an unknown name is a 404 there as everywhere, a loaded one serves."""
    _, client, _, _ = served
    echo = {"prompt": [5, 6, 7], "max_tokens": 0, "echo": True}
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5, 6]}), ("/v1/completions", echo)):
        known = client.simulate_post(path, json={**body, "model": "first"})
        unknown = client.simulate_post(path, json={**body, "model": "nobody"})
        assert known.status_code == 200, (path, known.text)
        assert unknown.status_code == 404 and unknown.json["error"]["param"] == "model", (path, unknown.text)


def test_adapters_load_and_unload_while_serving(served, tmp_path):
    engine, client, first, second = served
    load = lambda body: client.simulate_post("/v1/load_lora_adapter", json=body)  # noqa: E731
    answer = load({"lora_name": "second", "lora_path": str(second)})
    assert answer.status_code == 200 and answer.text == "Success: LoRA adapter 'second' added successfully."
    assert {card["id"] for card in client.simulate_get("/v1/models").json["data"]} == {"tiny", "first", "second"}
    assert client.simulate_post("/v1/completions", json={**BODY, "model": "second"}).json["choices"][0]["text"] == _text(engine, "second")
    malformed = shutil.copytree(second, tmp_path / "malformed")  # a weights file whose header lies
    (malformed / "adapter_model.safetensors").write_bytes(
        _safetensors({"x": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}, 4))
    refusals = [
        ({"lora_name": "second", "lora_path": str(second)}, 400, "lora_name"),  # the name is taken
        ({"lora_name": "first", "lora_path": str(malformed), "load_inplace": True}, 400, "lora_path"),
        ({"lora_name": "first", "lora_path": str(tmp_path), "load_inplace": True}, 400, "lora_path"),  # not a PEFT folder
        ({"lora_name": "first", "lora_path": str(tmp_path / "gone"), "load_inplace": True}, 404, "lora_path"),
        ({"lora_name": "second"}, 400, "lora_path"),  # (the schema's)
    ]
    for body, status, param in refusals:
        refused = load(body)
        assert (refused.status_code, refused.json["error"]["param"]) == (status, param), (body, refused.json)
    assert load({"lora_name": "second", "lora_path": str(first), "load_inplace": True}).status_code == 200
    assert client.simulate_post("/v1/completions", json={**BODY, "model": "second"}).json["choices"][0]["text"] == _text(engine, "first")
    with_id = client.simulate_post("/v1/unload_lora_adapter", json={"lora_name": "second", "lora_int_id": 2})
    assert with_id.status_code == 400 and with_id.json["error"]["param"] == "lora_int_id"  # refused, not ignored
    unload = lambda: client.simulate_post("/v1/unload_lora_adapter", json={"lora_name": "second"})  # noqa: E731
    assert unload().text == "Success: LoRA adapter 'second' removed successfully."
    again = unload()
    assert again.status_code == 404 and again.json["error"]["param"] == "lora_name"
    assert client.simulate_post("/v1/completions", json={**BODY, "model": "second"}).status_code == 404


def test_a_start_up_adapters_base_model_name_is_its_parent(served, tiny_model_dir):
    """vLLM's JSON form of --lora-modules: its base_model_name (one of the served names) is the card's parent."""
    engine, _, first, _ = served
    import json

    module = json.dumps({"name": "first", "path": str(first), "base_model_name": "alias"})
    settings = tiny_settings(tiny_model_dir, enable_lora=True, lora_modules=[module], served_model_name=["tiny", "alias"])
    settings.validate()
    cards = {card["id"]: card for card in api_client(served_app(engine, settings)).simulate_get("/v1/models").json["data"]}
    assert (cards["first"]["root"], cards["first"]["parent"]) == (str(first), "alias")


def test_without_the_flag_there_are_no_adapter_routes(tiny_engine, tiny_model_dir):
    settings = tiny_settings(tiny_model_dir, served_model_name=["tiny"])
    client = api_client(served_app(tiny_engine, settings))
    assert client.simulate_post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}).status_code == 404
    assert "/v1/load_lora_adapter" not in client.simulate_get("/openapi.json").json["paths"]
    refused = client.simulate_post("/v1/completions", json={**BODY, "model": "first"})
    assert refused.status_code == 404 and refused.json["error"]["param"] == "model"
