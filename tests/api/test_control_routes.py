"""The RL trainers' control routes (``--enable-rl-endpoints``) on a live engine: a pause in each
mode, the resume, ``/is_paused``, and aborting requests by the ids their clients gave."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from gyrfalcon.config import Settings
from gyrfalcon.protocol.endpoints import CONTROL_ROUTES
from tests.api.test_abort import http_scope
from tests.helpers import api_client, served_app

GENERATE = "/inference/v1/generate"
LONG = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 60, "temperature": 0, "ignore_eos": True}}


@pytest.fixture
def control(slow_engine, tiny_model_dir):
    settings = Settings(model=tiny_model_dir, served_model_name=["tiny"], enable_rl_endpoints=True)
    client = api_client(served_app(slow_engine, settings))
    yield client
    slow_engine.resume()


def _sent(client, body: dict) -> tuple[threading.Thread, dict]:
    """``body`` posted to generate from a thread of its own, straight to the client's app on an
    event loop of that thread (the test client runs one request at a time); its answer lands in
    the dict as ``status`` and ``json``."""
    result: dict = {}
    raw = json.dumps(body).encode()

    def post() -> None:
        messages, sent = [{"type": "http.request", "body": raw, "more_body": False}], []

        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            await asyncio.Event().wait()  # this client never leaves
            return {}

        async def send(message: dict) -> None:
            sent.append(message)

        asyncio.run(client.app(http_scope(GENERATE, raw), receive, send))
        answer = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        result.update(status=sent[0]["status"], json=json.loads(answer))

    thread = threading.Thread(target=post)
    thread.start()
    return thread, result


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def _choice(result: dict) -> dict:
    assert result["status"] == 200, result
    return result["json"]["choices"][0]


def test_the_routes_are_served_only_when_asked(client, control):
    assert not set(CONTROL_ROUTES) & set(client.simulate_get("/openapi.json").json["paths"])
    assert client.simulate_post("/pause").status_code == 404
    assert set(CONTROL_ROUTES) <= set(control.simulate_get("/openapi.json").json["paths"])
    assert control.simulate_get("/is_paused").json == {"is_paused": False, "mode": None, "held": 0}


def test_keep_freezes_what_runs_holds_what_comes_and_the_resume_finishes_both(control, slow_engine):
    alone = control.simulate_post(GENERATE, json=LONG).json["choices"][0]["token_ids"]
    first_thread, first = _sent(control, LONG)
    _until(lambda: slow_engine.stats()["running"] == 1, "the first request runs")
    paused = control.simulate_post("/pause", params={"mode": "keep"})
    assert paused.status_code == 200 and paused.json == {"status": "paused", "mode": "keep", "held": 0}, paused.text
    steps = slow_engine.stats()["decode_forwards"]
    second_thread, second = _sent(control, {**LONG, "request_id": "later"})
    _until(lambda: control.simulate_get("/is_paused").json["held"] == 1, "the second request is held")
    time.sleep(0.2)
    assert slow_engine.stats()["decode_forwards"] == steps and not first and not second  # nothing ran
    assert control.simulate_post("/resume").json == {"status": "resumed", "mode": None, "held": 0}
    first_thread.join(20), second_thread.join(20)
    for result in (first, second):  # greedy: the frozen request's tokens are those it makes unpaused
        assert _choice(result)["token_ids"] == alone and _choice(result)["finish_reason"] == "length"


def test_abort_ends_what_runs_and_wait_lets_it_finish(control, slow_engine):
    thread, result = _sent(control, LONG)
    _until(lambda: slow_engine.stats()["running"] == 1, "the request runs")
    assert control.simulate_post("/pause", params={"mode": "abort", "clear_cache": "false"}).json["mode"] == "abort"
    thread.join(20)
    assert _choice(result)["finish_reason"] == "abort" and len(_choice(result)["token_ids"]) < 60
    control.simulate_post("/resume")
    thread, result = _sent(control, LONG)
    _until(lambda: slow_engine.stats()["running"] == 1, "the request runs")
    assert control.simulate_post("/pause", params={"mode": "wait"}).json["mode"] == "wait"
    assert slow_engine.stats()["running"] == 0  # the answer came once the request had finished
    thread.join(20)
    assert _choice(result)["finish_reason"] == "length" and len(_choice(result)["token_ids"]) == 60
    control.simulate_post("/resume")


def test_abort_requests_ends_those_of_the_ids_given_only(control, slow_engine):
    mine_thread, mine = _sent(control, {**LONG, "request_id": "mine"})
    theirs_thread, theirs = _sent(control, {**LONG, "request_id": "theirs"})
    _until(lambda: slow_engine.stats()["running"] == 2, "both requests run")
    answer = control.simulate_post("/inference/v1/abort_requests", json={"request_ids": ["mine"]})
    assert answer.json == {"status": "aborted", "aborted": 1}, answer.text
    mine_thread.join(20), theirs_thread.join(20)
    assert _choice(mine)["finish_reason"] == "abort" and _choice(theirs)["finish_reason"] == "length"
    assert control.simulate_get("/is_paused").json["is_paused"] is False


@pytest.mark.parametrize(("path", "params", "body", "param"), [
    ("/pause", {"mode": "sometimes"}, None, "mode"),
    ("/pause", {"clear_cache": "maybe"}, None, "clear_cache"),
    ("/pause", {"force": "1"}, None, "force"),
    ("/resume", {"mode": "keep"}, None, "mode"),
    ("/inference/v1/abort_requests", {}, {"request_ids": "mine"}, "request_ids"),
    ("/inference/v1/abort_requests", {}, {"ids": ["mine"]}, "ids"),
])  # fmt: skip
def test_what_a_control_route_cannot_honour_is_a_400_naming_it(control, path, params, body, param):
    answer = control.simulate_post(path, params=params, json=body)
    assert answer.status_code == 400 and answer.json["error"]["param"] == param, answer.text
    assert control.simulate_get("/is_paused").json["is_paused"] is False
