"""LoRA adapters on a live server (gunicorn, the engine in its own process) through the ``openai`` SDK:
the adapter is a ``model``; vLLM's load and unload routes change what serves."""

from __future__ import annotations

import openai
import pytest
import requests

from tests.live_server import start_server, stop_server
from tests.unit.test_lora import write_adapter

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("live-adapters")
    first, second = write_adapter(tiny_model_dir, folder / "first", seed=1), write_adapter(tiny_model_dir, folder / "second", seed=2)
    server = start_server(["--model", tiny_model_dir, "--max-model-len", "128", "--max-num-seqs", "4", "--num-threads", "1",
                           "--served-model-name", "tiny", "--enable-lora", "--lora-modules", f"first={first}",
                           "--max-loras", "2"], str(tmp_path_factory.mktemp("lora-live") / "server.log"))  # fmt: skip
    yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60), second
    stop_server(server)


def test_the_sdk_names_adapters_as_models(served):
    server, client, second = served
    assert {m.id for m in client.models.list().data} == {"tiny", "first"}
    ask = dict(prompt="Hello there", max_tokens=8, temperature=0, logprobs=1)
    base, first = client.completions.create(model="tiny", **ask), client.completions.create(model="first", **ask)
    assert first.model == "first" and first.choices[0].logprobs.token_logprobs != base.choices[0].logprobs.token_logprobs
    loaded = requests.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": str(second)},
                           timeout=60)  # fmt: skip
    assert loaded.status_code == 200, loaded.text
    chat = client.chat.completions.create(model="second", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "second" and chat.choices[0].finish_reason in ("stop", "length")
    assert requests.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "second"}, timeout=60).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="second", **ask)
    again = client.completions.create(model="first", **ask)  # the same answer, whatever came between
    assert again.choices[0].logprobs.token_logprobs == first.choices[0].logprobs.token_logprobs
