"""Sleep and wake up between rollout phases (``/sleep``, ``/wake_up``, ``/is_sleeping``,
``--enable-rl-endpoints``): the memory goes back to the system and comes back, requests sent while
asleep wait for the wake, and the engine then computes exactly what it did before."""

from __future__ import annotations

import os
import time

import pytest

from gyrfalcon.config import Settings
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.api.test_control_routes import GENERATE, _sent, _until
from tests.api.test_weight_updates import PROBE, new_weights  # noqa: F401 - a fixture
from tests.conftest import tiny_settings
from tests.helpers import api_client, served_app

#: the KV cache's bytes: far above what the tiny model's weights and the process's noise take
CACHE_BYTES = 192 << 20
AWAKE = {"is_sleeping": False, "level": 0, "asleep": []}


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = create_transformers_engine(tiny_settings(tiny_model_dir, max_model_len=256, kv_cache_memory=CACHE_BYTES))
    assert engine.wait_ready(60).ready
    yield engine
    engine.shutdown(0)


@pytest.fixture
def control(engine, tiny_model_dir):
    settings = Settings(model=tiny_model_dir, served_model_name=["tiny"], enable_rl_endpoints=True)
    client = api_client(served_app(engine, settings))
    yield client
    client.simulate_post("/wake_up")


def _probe(client, fresh: bool = False) -> dict:
    """The probe's answer (``fresh``: computed from an empty prefix cache, as after any sleep; a
    cached prompt's fp32 logprobs may differ in their last bits)."""
    if fresh:
        assert client.simulate_post("/pause", params={"mode": "wait"}).status_code == 200
        assert client.simulate_post("/resume").status_code == 200
    answer = client.simulate_post(GENERATE, json=PROBE)
    assert answer.status_code == 200, answer.text
    choice = answer.json["choices"][0]
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]}


def test_level_1_hands_the_kv_cache_back_holds_requests_and_wakes_to_the_same_answers(control, engine):
    before, cache = _probe(control, fresh=True), engine.core.cache_plan.bytes
    assert cache >= CACHE_BYTES * 0.9
    awake = _resident()
    answer = control.simulate_post("/sleep")
    assert answer.status_code == 200 and answer.json == {"is_sleeping": True, "level": 1, "asleep": ["kv_cache"]}
    asleep = _resident()
    assert awake - asleep >= 0.9 * cache, (awake, asleep, cache)
    assert control.simulate_get("/is_sleeping").json == answer.json
    refused = control.simulate_post("/resume")
    assert refused.status_code == 400 and "/wake_up" in refused.json["error"]["message"]

    thread, held = _sent(control, PROBE)
    _until(lambda: engine.pause_state().held == 1, "the request sent while asleep is held")
    time.sleep(0.1)
    assert not held and engine.stats()["running"] == 0
    answer = control.simulate_post("/wake_up")
    assert answer.status_code == 200 and answer.json == AWAKE, answer.text
    assert _resident() - asleep >= 0.9 * cache  # taken up front again, as at start-up
    thread.join(20)
    assert held["status"] == 200, held
    choice = held["json"]["choices"][0]
    assert {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]} == before
    assert _probe(control)["tokens"] == before["tokens"]  # its prompt cached now: fp32's last bits may differ
    assert control.simulate_get("/is_paused").json["is_paused"] is False


def test_level_2_reloads_the_weights_and_an_update_while_asleep_takes_them_back(control, engine, new_weights,
                                                                                tiny_model_dir):  # fmt: skip
    before = _probe(control, fresh=True)
    assert control.simulate_post("/sleep", params={"level": "2"}).json == {
        "is_sleeping": True, "level": 2, "asleep": ["kv_cache", "weights"]}  # fmt: skip
    partly = control.simulate_post("/wake_up", params={"tags": "weights"})
    assert partly.json == {"is_sleeping": True, "level": 2, "asleep": ["kv_cache"]}, partly.text
    assert control.simulate_post("/wake_up", params={"tags": "kv_cache"}).json == AWAKE
    assert _probe(control) == before  # loaded again from the model folder: the same bits

    assert control.simulate_post("/sleep", params={"level": "2"}).status_code == 200
    update = control.simulate_post("/update_weights_from_disk", json={"model_path": new_weights, "weight_version": "v2"})
    assert update.status_code == 200, update.text
    assert control.simulate_get("/is_sleeping").json["asleep"] == ["kv_cache"]  # the update wrote every weight
    assert control.simulate_post("/wake_up").json == AWAKE
    changed = _probe(control)
    assert changed["tokens"] != before["tokens"]
    assert control.simulate_post("/sleep", params={"level": "2"}).status_code == 200
    assert control.simulate_post("/wake_up").json == AWAKE
    assert _probe(control) == changed  # reloaded from where the weights last came from
    assert control.simulate_get("/weight_version").json == {"weight_version": "v2"}
    control.simulate_post("/update_weights_from_disk", json={"model_path": tiny_model_dir, "weight_version": "default"})
    assert _probe(control, fresh=True) == before


@pytest.mark.parametrize(("route", "params", "param"), [
    ("/sleep", {"level": "3"}, "level"), ("/sleep", {"level": "one"}, "level"), ("/wake_up", {"tags": "disk"}, "tags"),
    ("/sleep", {"depth": "1"}, "depth")])  # fmt: skip
def test_what_sleep_cannot_honour_is_a_400_naming_the_parameter(control, route, params, param):
    answer = control.simulate_post(route, params=params)
    assert answer.status_code == 400 and answer.json["error"]["param"] == param, answer.text
    assert control.simulate_get("/is_sleeping").json == AWAKE
