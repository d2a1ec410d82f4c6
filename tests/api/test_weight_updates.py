"""New weights while serving (``POST /update_weights_from_disk``, ``--enable-rl-endpoints``): the
engine then computes exactly what an engine started on them computes, cached prefixes included;
a folder that does not fit is a 400 naming the tensor and changes nothing; a choice that runs
across the swap says from which token on the new weights made it."""

from __future__ import annotations

import json

import pytest

from gyrfalcon.config import Settings
from gyrfalcon.models.tiny import build_tiny_model
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.api.test_control_routes import GENERATE, LONG, _sent, _until
from tests.conftest import tiny_settings
from tests.helpers import api_client, served_app

#: greedy with logprobs: the tokens and the values the weights give them
PROBE = {"token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
         "sampling_params": {"max_tokens": 12, "temperature": 0, "logprobs": 2, "ignore_eos": True}}  # fmt: skip


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory) -> str:
    """The tiny model's architecture and tokenizer with other weights."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-new"), seed=1))


@pytest.fixture
def control(slow_engine, tiny_model_dir):
    settings = Settings(model=tiny_model_dir, served_model_name=["tiny"], enable_rl_endpoints=True)
    yield api_client(served_app(slow_engine, settings))


def _probe(client) -> dict:
    answer = client.simulate_post(GENERATE, json=PROBE)
    assert answer.status_code == 200, answer.text
    choice = answer.json["choices"][0]
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]}


def test_new_weights_compute_what_an_engine_started_on_them_computes(control, new_weights, tiny_model_dir):
    before = _probe(control)  # its prompt's blocks are now in the prefix cache
    answer = control.simulate_post("/update_weights_from_disk", json={"model_path": new_weights, "weight_version": "v2"})
    assert answer.status_code == 200 and answer.json["success"] and answer.json["weight_version"] == "v2", answer.text
    assert control.simulate_get("/weight_version").json == {"weight_version": "v2"}
    assert control.simulate_get("/health").json["weight_version"] == "v2"
    assert control.simulate_get("/v1/models").json["data"][0]["weight_version"] == "v2"
    assert 'gyrfalcon_weight_version{version="v2"} 1.0' in control.simulate_get("/metrics").text
    after = _probe(control)
    fresh = create_transformers_engine(tiny_settings(new_weights, max_model_len=256))
    try:
        assert fresh.wait_ready(60).ready
        settings = Settings(model=new_weights, served_model_name=["tiny"], enable_rl_endpoints=True)
        expected = _probe(api_client(served_app(fresh, settings)))
    finally:
        fresh.shutdown(0)
    assert after == expected and after["tokens"] != before["tokens"]
    assert control.simulate_post("/update_weights_from_disk", json={"model_path": tiny_model_dir}).json[
        "weight_version"] == "update-2"  # unnamed: numbered  # fmt: skip
    assert _probe(control) == before  # the first weights again, computed as at the start


def test_weights_that_do_not_fit_are_a_400_naming_the_tensor_and_change_nothing(control, tmp_path):
    _probe(control)
    before = _probe(control)  # from the prefix cache, which a refused update leaves as it is
    other = build_tiny_model(tmp_path / "other", vocab_size=384)
    answer = control.simulate_post("/update_weights_from_disk", json={"model_path": str(other)})
    assert answer.status_code == 400 and answer.json["error"]["param"] == "model_path", answer.text
    assert "model.embed_tokens.weight" in answer.json["error"]["message"]
    missing = control.simulate_post("/update_weights_from_disk", json={"model_path": str(tmp_path / "none")})
    assert missing.status_code == 404 and missing.json["error"]["param"] == "model_path", missing.text
    not_a_model = control.simulate_post("/update_weights_from_disk", json={"model_path": str(tmp_path)})
    assert not_a_model.status_code == 400 and not_a_model.json["error"]["param"] == "model_path", not_a_model.text
    assert control.simulate_get("/weight_version").json == {"weight_version": "default"}
    assert _probe(control) == before


def test_a_choice_across_the_swap_says_which_weights_made_which_tokens(control, slow_engine, new_weights):
    thread, result = _sent(control, LONG)
    _until(lambda: slow_engine.stats()["running"] == 1, "the request runs")
    control.simulate_post("/update_weights_from_disk", json={"model_path": new_weights, "weight_version": "v2"})
    thread.join(20)
    choice = result["json"]["choices"][0]
    (first, second) = choice["weight_versions"]
    assert first == {"version": "default", "start": 0} and second["version"] == "v2"
    assert 0 < second["start"] < len(choice["token_ids"]) == 60
    later = control.simulate_post(GENERATE, json=LONG).json["choices"][0]
    assert later["weight_versions"] == [{"version": "v2", "start": 0}]
    # the Responses API says it on the finished response, stored, streamed or not
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4}
    answer = control.simulate_post("/v1/responses", json=body).json
    assert answer["weight_versions"] == [{"version": "v2", "start": 0}], answer
    assert control.simulate_get(f"/v1/responses/{answer['id']}").json["weight_versions"] == answer["weight_versions"]
    events = [json.loads(line[6:]) for line in control.simulate_post("/v1/responses", json={**body, "stream": True}).text
              .splitlines() if line.startswith("data: {")]  # fmt: skip
    assert events[-1]["response"]["weight_versions"] == [{"version": "v2", "start": 0}]
    assert "weight_versions" not in events[0]["response"]  # in progress: nothing finished yet


def test_blocks_computed_across_a_swap_are_never_a_cached_prefix_of_the_new_weights(control, slow_engine, new_weights):
    """A choice running across the swap fills blocks whose KV mixes both weights' work: a later
    request with the same tokens must not find them (cached prefixes are keyed by the weights that
    computed them from their first block on)."""
    thread, result = _sent(control, LONG)
    _until(lambda: slow_engine.stats()["running"] == 1, "the request runs")
    control.simulate_post("/update_weights_from_disk", json={"model_path": new_weights, "weight_version": "v2"})
    thread.join(20)
    tokens = LONG["token_ids"] + result["json"]["choices"][0]["token_ids"]
    probe = {"token_ids": tokens[:60], "sampling_params": {"max_tokens": 4, "temperature": 0, "logprobs": 0}}
    cached = control.simulate_post(GENERATE, json=probe).json["choices"][0]
    control.simulate_post("/pause", params={"mode": "wait"})  # the prefix cache forgets every block
    control.simulate_post("/resume")
    computed = control.simulate_post(GENERATE, json=probe).json["choices"][0]
    assert cached["token_ids"] == computed["token_ids"]
    for a, b in zip(cached["logprobs"]["content"], computed["logprobs"]["content"]):
        assert abs(a["logprob"] - b["logprob"]) < 1e-4, (a, b)


def test_sglangs_fields_are_honoured_or_refused(control, slow_engine, tiny_model_dir):
    """SGLang's body as its trainers send it: ``abort_all_requests`` ends what runs first,
    ``load_format`` only as the path says, the cache flags accepted."""
    refused = control.simulate_post("/update_weights_from_disk", json={"model_path": tiny_model_dir, "load_format": "dummy"})
    assert refused.status_code == 400 and refused.json["error"]["param"] == "load_format", refused.text
    thread, result = _sent(control, LONG)
    _until(lambda: slow_engine.stats()["running"] == 1, "the request runs")
    body = {"model_path": tiny_model_dir, "load_format": None, "abort_all_requests": True, "flush_cache": False,
            "torch_empty_cache": True, "weight_version": "v3"}  # fmt: skip
    answer = control.simulate_post("/update_weights_from_disk", json=body)
    assert answer.status_code == 200 and answer.json["weight_version"] == "v3", answer.text
    thread.join(20)
    choice = result["json"]["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["weight_versions"] == [{"version": "default", "start": 0}]
