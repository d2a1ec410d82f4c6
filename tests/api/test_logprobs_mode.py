"""``--logprobs-mode`` end to end: the served spec states the mode, and a server in
``processed_logprobs`` returns what the raw server's logprobs give once temperature and top-k are
applied to them, for the same tokens (the mode changes what is reported, never what is sampled)."""

from __future__ import annotations

import math

import pytest

from gyrfalcon.config import Settings
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.conftest import tiny_settings
from tests.helpers import api_client, served_app

TEMPERATURE, TOP_K = 0.6, 3
BODY = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 6, "n": 2, "temperature": TEMPERATURE, "top_k": TOP_K,
                                                   "logprobs": TOP_K, "seed": 11}}  # fmt: skip


@pytest.fixture(scope="module")
def processed_client(tiny_model_dir):
    engine = create_transformers_engine(tiny_settings(tiny_model_dir, logprobs_mode="processed_logprobs"))
    assert engine.wait_ready(60).ready
    yield api_client(served_app(engine, Settings(model=tiny_model_dir, served_model_name=["tiny"],
                                                 logprobs_mode="processed_logprobs")))  # fmt: skip
    engine.shutdown(grace=1.0)


def _positions(answer: dict) -> list[list[tuple[list[int], dict[int, float], int, float]]]:
    """Per choice, per position: the sampled token, its logprob and the top tokens' logprobs by id."""
    out = []
    for choice in answer["choices"]:
        rows = []
        for entry in choice["logprobs"]["content"]:
            top = {int(t["token"].removeprefix("token_id:")): t["logprob"] for t in entry["top_logprobs"]}
            rows.append((int(entry["token"].removeprefix("token_id:")), entry["logprob"], top))
        out.append(rows)
    return out


def test_the_served_spec_states_the_mode(client, processed_client):
    assert client.simulate_get("/openapi.json").json["x-logprobs-mode"]["mode"] == "raw_logprobs"
    stated = processed_client.simulate_get("/openapi.json").json["x-logprobs-mode"]
    assert stated["mode"] == "processed_logprobs" and "temperature" in stated["description"]


def test_processed_logprobs_are_the_raw_ones_after_temperature_and_top_k(client, processed_client):
    raw = client.simulate_post("/inference/v1/generate", json=BODY)
    processed = processed_client.simulate_post("/inference/v1/generate", json=BODY)
    assert raw.status_code == processed.status_code == 200, (raw.text, processed.text)
    assert [c["token_ids"] for c in raw.json["choices"]] == [c["token_ids"] for c in processed.json["choices"]]
    for raw_rows, processed_rows in zip(_positions(raw.json), _positions(processed.json)):
        for (token, _, raw_top), (same, logprob, top) in zip(raw_rows, processed_rows):
            assert token == same and set(top) == set(raw_top) and token in top
            scaled = {t: v / TEMPERATURE for t, v in raw_top.items()}
            total = math.log(math.fsum(math.exp(v) for v in scaled.values()))
            for t, v in top.items():
                assert v == pytest.approx(scaled[t] - total, abs=1e-4), (t, v)
            assert logprob == pytest.approx(top[token], abs=1e-6)
            assert math.fsum(math.exp(v) for v in top.values()) == pytest.approx(1.0, abs=1e-5)
