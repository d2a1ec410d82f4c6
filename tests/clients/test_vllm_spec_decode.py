"""vLLM's speculative-decoding correctness test, ported to a live server (``openai`` SDK).

Ports tests/v1/e2e/test_spec_decode.py's ``test_ngram_correctness``: a mixed set of prompts, some a
prompt-lookup proposal predicts ("repeat the sentence") and some it does not ("a sentence with the
word"), answered greedily by a server that speculates and compared with the answers of one that does
not. vLLM accepts two thirds of them equal; gyrfalcon verifies exactly (every kept token is the one
its own step draws), so every answer must be equal, its logprobs and top logprobs included, on chat
and completions alike. The reference is the same tiny model served without speculation in process,
through the same app.
"""

from __future__ import annotations

import json
import random

import openai
import pytest
import requests

from tests.conftest import tiny_settings
from tests.helpers import api_client, served_app
from tests.live_server import start_server, stop_server

pytestmark = pytest.mark.live

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SERVER_ARGS = ["--max-model-len", "256", "--max-num-seqs", "4", "--num-threads", "1", "--served-model-name", "tiny",
               "--quantization", "int4"]  # fmt: skip


def prompts(count: int = 16) -> list[str]:
    """vLLM's two kinds, on its four words, in a seeded order."""
    rng = random.Random(0)
    out = []
    for _ in range(count):
        word = rng.choice(["test", "temp", "hello", "where"])
        if rng.random() < 0.5:
            out.append(f"Can you repeat the sentence ten times, this is a {word}.")
        else:
            out.append(f"Please give a ten-word sentence that uses the word {word} at least once.")
    return out


@pytest.fixture(scope="module")
def speculating(tiny_model_dir, tmp_path_factory):
    server = start_server(["--model", tiny_model_dir, *SERVER_ARGS, "--speculative-config", json.dumps(NGRAM)],
                          str(tmp_path_factory.mktemp("spec-live") / "server.log"))  # fmt: skip
    yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stop_server(server)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from gyrfalcon.plugins.engines import create_transformers_engine

    settings = tiny_settings(tiny_model_dir, max_model_len=256, max_num_seqs=4, quantization="int4",
                             served_model_name=["tiny"])  # fmt: skip
    engine = create_transformers_engine(settings)
    assert engine.wait_ready(60).ready
    yield api_client(served_app(engine, settings))
    engine.shutdown(0)


def _choices(body: dict) -> list[tuple]:
    """What a choice says, whatever the endpoint: its text, its finish, its logprobs (fields the SDK
    adds as null, such as chat's ``refusal``, left out)."""
    out = []
    for choice in body["choices"]:
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        out.append((text, choice["finish_reason"], json.dumps(_set(choice["logprobs"]), sort_keys=True)))
    return out


def _set(value):
    if isinstance(value, dict):
        return {k: _set(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_set(v) for v in value]
    return value


def test_ngram_correctness(speculating, reference):
    server, client = speculating
    assert client.models.list().data[0].id == "tiny"
    for i, prompt in enumerate(prompts()):
        if i % 2:
            body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                    "max_tokens": 30, "logprobs": True, "top_logprobs": 2}  # fmt: skip
            answer = client.chat.completions.create(**body).model_dump()
            expected = reference.simulate_post("/v1/chat/completions", json=body).json
        else:
            body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 30, "logprobs": 2}
            answer = client.completions.create(**body).model_dump()
            expected = reference.simulate_post("/v1/completions", json=body).json
        assert _choices(answer) == _choices(expected), prompt
    health = requests.get(server.url + "/health", timeout=10).json()
    assert health["speculative"].startswith("ngram ("), health
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    accepted = [line for line in metrics.splitlines() if line.startswith("gyrfalcon:spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].rsplit(" ", 1)[1]) > 0, accepted
