"""The Responses API in-process on the tiny model: the store's bounds and time to live, input item
pages, cancel, chaining, and refusals named as the Responses API writes them."""

from __future__ import annotations

import json
import time

import pytest

from gyrfalcon.config import Settings
from tests.helpers import api_client, served_app

PATH = "/v1/responses"
TOOL = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
    "additionalProperties": False}}  # fmt: skip


def _client(engine, model_dir, tmp_path, **settings):
    values = dict(model=str(model_dir), served_model_name=["tiny"], cache_dir=str(tmp_path))
    values.update(settings)
    return api_client(served_app(engine, Settings(**values)))


@pytest.fixture
def client(tiny_engine, tiny_model_dir, tmp_path):
    return _client(tiny_engine, tiny_model_dir, tmp_path)


def _events(text: str) -> list[dict]:
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: "):])
        assert event["type"] == name[len("event: "):]
        events.append(event)
    return events


def test_the_oldest_go_first_and_say_they_were_evicted(tiny_engine, tiny_model_dir, tmp_path):
    client = _client(tiny_engine, tiny_model_dir, tmp_path, responses_store_size=2)
    ids = [client.simulate_post(PATH, json={"input": f"hi {i}", "max_output_tokens": 2}).json["id"] for i in range(3)]
    first = client.simulate_get(f"{PATH}/{ids[0]}")
    assert first.status_code == 404 and "evicted" in first.json["error"]["message"]
    assert [client.simulate_get(f"{PATH}/{i}").status_code for i in ids[1:]] == [200, 200]
    never = client.simulate_get(f"{PATH}/resp_never")
    assert never.status_code == 404 and "evicted" not in never.json["error"]["message"]


def test_a_response_lives_its_time_to_live(tiny_engine, tiny_model_dir, tmp_path):
    client = _client(tiny_engine, tiny_model_dir, tmp_path, responses_ttl=0.3)
    rid = client.simulate_post(PATH, json={"input": "hi", "max_output_tokens": 2}).json["id"]
    assert client.simulate_get(f"{PATH}/{rid}").status_code == 200
    time.sleep(0.4)
    later = client.simulate_post(PATH, json={"input": "x", "max_output_tokens": 2, "previous_response_id": rid})
    assert later.status_code == 404 and later.json["error"]["param"] == "previous_response_id"


def test_a_purge_drops_what_expired_without_a_read_or_a_write(tmp_path):
    from gyrfalcon.api.response_store import ResponseStore

    store = ResponseStore(tmp_path / "responses" / "r.sqlite3", size=10, ttl=0.2)
    store.put({"id": "resp_a", "status": "completed"}, [], [])
    assert len(store) == 1
    time.sleep(0.3)
    store.purge()
    assert len(store) == 0
    with pytest.raises(Exception, match="no longer stored"):
        store.response("resp_a")


def _lapsed_leases(tmp_path, monkeypatch, renewed_status: str):
    """A store holding ``resp_orphan`` (running, its lease lapsed), ``resp_renewed`` (its worker
    vouched for it in time) and ``resp_done`` (ended); the clock just past the lease. Returns the
    store and the time the three were stored."""
    from gyrfalcon.api import response_store
    from gyrfalcon.api.response_store import LEASE_S, ResponseStore

    store = ResponseStore(tmp_path / "responses" / "r.sqlite3", size=10, ttl=3600)
    for name, status in (("orphan", "in_progress"), ("renewed", renewed_status), ("done", "completed")):
        store.put({"id": f"resp_{name}", "status": status}, [], [], owner="k")
    now = time.time()
    monkeypatch.setattr(response_store.time, "time", lambda: now + LEASE_S - 1)
    store.renew("resp_renewed")
    monkeypatch.setattr(response_store.time, "time", lambda: now + LEASE_S + 1)
    return store, now


def test_a_response_whose_worker_went_is_read_as_failed_once_its_lease_lapses(tmp_path, monkeypatch):
    """A worker killed while a background response runs stores nothing of its end: the response's
    lease (renewed by its worker every few seconds) lapses, and the next read marks it failed and
    says why; a renewed one, and one that ended, are left as they are."""
    from gyrfalcon.api.response_store import ORPHANED

    store, _ = _lapsed_leases(tmp_path, monkeypatch, renewed_status="in_progress")
    assert store.response("resp_orphan", owner="k") == {"id": "resp_orphan", "status": "failed", "error": ORPHANED}
    assert store.response("resp_orphan", owner="k")["status"] == "failed"  # stored so
    assert store.response("resp_renewed", owner="k")["status"] == "in_progress"
    assert store.response("resp_done", owner="k")["status"] == "completed"
    assert store.put({"id": "resp_orphan", "status": "completed"}, [], [], owner="k", update=True)  # a late end still lands


def test_the_periodic_purge_marks_an_orphaned_response_failed_unread(tmp_path, monkeypatch):
    """Nobody reads it: the purge that runs every few minutes applies the lease all the same."""
    from gyrfalcon.api import response_store
    from gyrfalcon.api.response_store import ORPHANED

    store, now = _lapsed_leases(tmp_path, monkeypatch, renewed_status="queued")
    store.purge()
    monkeypatch.setattr(response_store.time, "time", lambda: now)  # no read may apply the lease now
    assert store.response("resp_orphan", owner="k") == {"id": "resp_orphan", "status": "failed", "error": ORPHANED}
    assert store.response("resp_renewed", owner="k")["status"] == "queued"
    assert store.response("resp_done", owner="k")["status"] == "completed"


def test_store_false_keeps_nothing_and_cancel_is_only_for_background(client):
    kept = client.simulate_post(PATH, json={"input": "hi", "max_output_tokens": 2}).json["id"]
    unkept = client.simulate_post(PATH, json={"input": "hi", "max_output_tokens": 2, "store": False}).json["id"]
    assert client.simulate_get(f"{PATH}/{unkept}").status_code == 404
    refused = client.simulate_post(f"{PATH}/{kept}/cancel")
    assert refused.status_code == 400 and "background" in refused.json["error"]["message"]
    assert client.simulate_post(f"{PATH}/resp_never/cancel").status_code == 404


def _until_ended(client, rid, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = client.simulate_get(f"{PATH}/{rid}").json
        if body["status"] not in ("queued", "in_progress"):
            return body
        time.sleep(0.05)
    raise AssertionError(f"{rid} still {body['status']}")


def test_a_background_response_answers_at_once_and_ends_in_the_store(client):
    r = client.simulate_post(PATH, json={"input": "hi", "max_output_tokens": 4, "background": True, "ignore_eos": True})
    assert r.status_code == 200 and r.json["status"] == "in_progress" and r.json["background"] is True
    assert r.json["output"] == []
    ended = _until_ended(client, r.json["id"])
    assert ended["status"] == "incomplete" and ended["usage"]["output_tokens"] == 4 and ended["output"]
    assert client.simulate_post(f"{PATH}/{r.json['id']}/cancel").json["status"] == "incomplete"  # ended: as it is
    for extra, param in (({"stream": True}, "stream"), ({"store": False}, "background")):
        refused = client.simulate_post(PATH, json={"input": "hi", "background": True, **extra})
        assert refused.status_code == 400 and refused.json["error"]["param"] == param


def test_input_items_come_in_pages(client):
    items = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "c"}]}]  # fmt: skip
    rid = client.simulate_post(PATH, json={"input": items, "max_output_tokens": 2}).json["id"]
    page = client.simulate_get(f"{PATH}/{rid}/input_items", params={"limit": 2, "order": "asc"}).json
    assert [i["content"][0]["text"] for i in page["data"]] == ["a", "b"] and page["has_more"] is True
    rest = client.simulate_get(f"{PATH}/{rid}/input_items", params={"order": "asc", "after": page["last_id"]}).json
    assert [i["content"][0]["text"] for i in rest["data"]] == ["c"] and rest["has_more"] is False
    newest = client.simulate_get(f"{PATH}/{rid}/input_items").json  # desc by default, as OpenAI
    assert [i["content"][0]["text"] for i in newest["data"]] == ["c", "b", "a"]
    assert [i["content"][0]["type"] for i in newest["data"]] == ["input_text", "output_text", "input_text"]


def test_a_bad_page_or_cancel_is_a_400_naming_its_param(client):
    rid = client.simulate_post(PATH, json={"input": "hi", "max_output_tokens": 2}).json["id"]
    for params, param in (({"order": "sideways"}, "order"), ({"after": "item_nobody"}, "after")):
        r = client.simulate_get(f"{PATH}/{rid}/input_items", params=params)
        assert r.status_code == 400 and r.json["error"]["param"] == param, r.json
        assert r.json["error"]["code"] == 400 and r.json["error"]["message"]
    cancel = client.simulate_post(f"{PATH}/{rid}/cancel")  # not in the background
    assert cancel.status_code == 400 and cancel.json["error"]["param"] == "response_id", cancel.json


def test_a_continuation_sees_the_turns_but_not_the_instructions(client):
    first = client.simulate_post(PATH, json={"input": "hi", "instructions": "be brief " * 10, "max_output_tokens": 2,
                                             "ignore_eos": True}).json  # fmt: skip
    plain = client.simulate_post(PATH, json={"input": "hi", "max_output_tokens": 2, "ignore_eos": True}).json
    chained = client.simulate_post(PATH, json={"input": "more", "max_output_tokens": 2,
                                               "previous_response_id": first["id"]}).json  # fmt: skip
    assert chained["previous_response_id"] == first["id"] and chained["instructions"] is None
    # the earlier turn and answer come first; the earlier instructions do not
    assert plain["usage"]["input_tokens"] < chained["usage"]["input_tokens"] < first["usage"]["input_tokens"] + 20


@pytest.mark.parametrize("extra,param", [
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]}, "input.0.arguments"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "tool", "content": "x"}]}, "input.1.role"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format.schema"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice.name"),
    ({"tools": [{**TOOL, "parameters": {"type": "nonsense"}}]}, "tools.0.parameters"),
    ({"logprob_token_ids": [1]}, "logprob_token_ids"),
    ({"top_logprobs": 50, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"conversation": "c"}, "conversation"),
])  # fmt: skip
def test_refusals_name_the_responses_field(client, extra, param):
    r = client.simulate_post(PATH, json={"input": "hi", "max_output_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json["error"]["param"] == param, r.json


def test_stored_responses_are_owned_by_their_key_and_named_by_the_server(tiny_engine, tiny_model_dir, tmp_path):
    """Two clients with the same request id each get a response of their own (the server names
    it); a response is another key's 404 for every verb, and the continuation of another key's
    response is a 404 naming previous_response_id; the file is 0600 in a 0700 folder."""
    import os
    import stat

    client = _client(tiny_engine, tiny_model_dir, tmp_path, api_keys=["key-a", "key-b"])
    a, b = ({"Authorization": f"Bearer key-{k}"} for k in "ab")
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    first = client.simulate_post(PATH, json=body, headers={**a, "X-Request-Id": "same"}).json
    second = client.simulate_post(PATH, json={**body, "request_id": "same"}, headers=b).json
    assert first["id"] != second["id"] and "same" not in first["id"] + second["id"]
    assert client.simulate_get(f"{PATH}/{first['id']}", headers=a).json["id"] == first["id"]
    for verb, path in (("GET", ""), ("DELETE", ""), ("GET", "/input_items"), ("POST", "/cancel")):
        r = client.simulate_request(verb, f"{PATH}/{first['id']}{path}", headers=b)
        assert r.status_code == 404 and "No stored response" in r.json["error"]["message"], (verb, path, r.text)
    r = client.simulate_post(PATH, json={**body, "previous_response_id": first["id"]}, headers=b)
    assert r.status_code == 404 and r.json["error"]["param"] == "previous_response_id"
    assert client.simulate_post(PATH, json={**body, "previous_response_id": first["id"]}, headers=a).status_code == 200
    folder = tmp_path / "responses"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(f).st_mode) & 0o077 == 0 for f in folder.iterdir())


def test_a_deleted_background_response_stays_deleted(client):
    r = client.simulate_post(PATH, json={"model": "tiny", "input": "hi", "max_output_tokens": 40, "background": True})
    assert r.status_code == 200 and r.json["status"] in ("queued", "in_progress")
    rid = r.json["id"]
    assert client.simulate_delete(f"{PATH}/{rid}").json["deleted"] is True
    deadline = time.monotonic() + 3.0  # the background response ends meanwhile (each request runs the
    while time.monotonic() < deadline:  # loop it runs on): its last write must not bring it back
        assert client.simulate_get(f"{PATH}/{rid}").status_code == 404
        time.sleep(0.05)


def test_a_stopping_worker_leaves_no_background_response_in_progress(slow_engine, tiny_model_dir, tmp_path):
    """A worker that stops while a background response runs: it gets the drain's time to end, then
    it is cancelled and stored as failed, never left in_progress by a worker that is gone."""
    import asyncio

    from gyrfalcon.api import resources

    client = _client(slow_engine, tiny_model_dir, tmp_path)
    r = client.simulate_post(PATH, json={"input": "hi", "max_output_tokens": 200, "background": True, "ignore_eos": True})
    assert r.status_code == 200 and r.json["status"] == "in_progress"
    (task,) = [t for t in resources._BACKGROUND if not t.done()]
    # the app's loop runs while the test client serves a request: the stop runs beside the polls
    stopping = asyncio.run_coroutine_threadsafe(resources.finish_background(0.05), task.get_loop())
    deadline = time.monotonic() + 10
    while not stopping.done() and time.monotonic() < deadline:
        client.simulate_get("/health")
        time.sleep(0.02)
    body = client.simulate_get(f"{PATH}/{r.json['id']}").json
    assert stopping.done() and body["status"] == "failed" and body["error"]["code"] == "server_shutting_down", body
