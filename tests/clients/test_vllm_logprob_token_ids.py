"""vLLM's ``logprob_token_ids`` tests, ported to the live server (HTTP, ``requests`` and ``openai``).

Ports:
- tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py (the end-to-end cases, and the
  request-level checks -- top-k decoupled from explicit ids, no beam search, no ``echo`` with
  ``max_tokens: 0`` -- sent over HTTP instead of built as pydantic models);
- tests/entrypoints/openai/chat_completion/test_logprob_token_ids_validation.py (vLLM validates the
  request models in-process; here the same bodies must come back as a 400 naming the field).

vLLM checks chat only; the same properties are checked on every endpoint that takes the field
(chat, batch chat, completions, /inference/v1/generate), streaming or not, and with n > 1. Our
contract is stricter than vLLM's first version of the test (which let the last requested id be
displaced): every position lists exactly the sampled token plus every requested id. On generate,
whose sampling params vLLM's engine takes as they come, ``logprobs`` is sent as the number of ids
(its engine refuses another count with both set, and so does gyrfalcon since issue 43).
"""

from __future__ import annotations

import math

import openai
import pytest
import requests

from tests.helpers import ok, refused, sse_events

pytestmark = pytest.mark.live

MSG = [{"role": "user", "content": "Hello"}]
MSG_2 = [{"role": "user", "content": "How are you?"}]
PROMPT_IDS = [1, 87, 85, 264, 201, 42]
#: vLLM's ids (100, 1000, 5000) scaled into the tiny model's 512-token vocabulary
REQUESTED = [100, 300, 500]
FORCED = 42

PATHS = {
    "chat": "/v1/chat/completions",
    "chat_batch": "/v1/chat/completions/batch",
    "completions": "/v1/completions",
    "generate": "/inference/v1/generate",
}
STREAMING = ["chat", "completions", "generate"]
ALL = list(PATHS)


# ------------------------------------------------------------------ helpers


def token_id(name: str) -> int:
    assert name.startswith("token_id:"), f"expected the token_id:<int> form, got {name!r}"
    return int(name.removeprefix("token_id:"))


def post(server, endpoint: str, body: dict) -> requests.Response:
    return requests.post(server.url + PATHS[endpoint], json=body, timeout=60)


def param_name(endpoint: str, field: str) -> str:
    return f"sampling_params.{field}" if endpoint == "generate" else field


def body_for(endpoint: str, top_k: int | None = None, ids: list[int] | None = None, **sampling) -> dict:
    """A request on ``endpoint`` asking for logprobs (``top_k``: chat top_logprobs / the count) and ``ids``."""
    fields = dict(sampling)
    if endpoint in ("chat", "chat_batch"):
        fields.update(logprobs=True, return_tokens_as_token_ids=True)
        if top_k is not None:
            fields["top_logprobs"] = top_k
    else:
        fields["logprobs"] = top_k if top_k is not None else 0
        if endpoint == "completions":
            fields["return_tokens_as_token_ids"] = True
    if ids is not None:
        fields["logprob_token_ids"] = ids
        if endpoint == "generate":  # vLLM's engine rule on generate's sampling params: the count is the ids'
            fields["logprobs"] = len(ids)
    stream = fields.pop("stream", None)
    if endpoint == "generate":
        body = {"token_ids": PROMPT_IDS, "sampling_params": fields}
    elif endpoint == "completions":
        body = {"prompt": PROMPT_IDS, **fields}
    elif endpoint == "chat":
        body = {"messages": MSG, **fields}
    else:
        body = {"messages": [MSG, MSG_2], **fields}
    if stream:
        body["stream"] = True
    return body


def positions(endpoint: str, logprobs: dict) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """``(sampled id, its logprob, [(listed id, logprob), ...])`` per position, in any endpoint's shape."""
    if endpoint == "completions":
        return [
            (token_id(tok), lp, [(token_id(name), value) for name, value in top.items()])
            for tok, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
        ]
    return [
        (token_id(e["token"]), e["logprob"], [(token_id(t["token"]), t["logprob"]) for t in e["top_logprobs"]])
        for e in logprobs["content"]
    ]


def assert_exactly_sampled_plus(endpoint: str, logprobs: dict, requested: list[int], count: int) -> list[int]:
    """Every position lists exactly its sampled token plus ``requested``, once each; returns the sampled ids."""
    rows = positions(endpoint, logprobs)
    assert len(rows) == count
    sampled_ids = []
    for sampled, lp, listed in rows:
        ids = [i for i, _ in listed]
        assert len(ids) == len(set(ids)), f"an id is listed twice: {ids}"
        assert set(ids) == {sampled, *requested}, (ids, sampled, requested)
        values = dict(listed)
        assert values[sampled] == pytest.approx(lp, abs=1e-6), "the sampled token's two logprobs disagree"
        for value in values.values():
            assert isinstance(value, float) and math.isfinite(value) and value <= 0.0
        sampled_ids.append(sampled)
    return sampled_ids


def assert_same_positions(endpoint: str, got: dict, want: dict) -> None:
    """Same ids everywhere, and logprobs equal up to float noise."""
    for (s1, lp1, top1), (s2, lp2, top2) in zip(positions(endpoint, got), positions(endpoint, want), strict=True):
        assert s1 == s2 and lp1 == pytest.approx(lp2, abs=1e-5)
        assert [i for i, _ in top1] == [i for i, _ in top2]
        assert [v for _, v in top1] == pytest.approx([v for _, v in top2], abs=1e-5)


def stream_logprobs(endpoint: str, text: str) -> dict[int, dict]:
    """Join a stream's per-chunk logprobs per choice index into one logprobs object of the JSON shape."""
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    joined: dict[int, dict] = {}
    for event in events[:-1]:
        assert "error" not in event, event
        assert len(event["choices"]) <= 1, "one choice per chunk"
        for choice in event["choices"]:
            lp = choice.get("logprobs")
            if lp is None:
                continue
            empty = {"content": [], "tokens": [], "token_logprobs": [], "top_logprobs": []}
            slot = joined.setdefault(choice["index"], empty)
            if endpoint == "completions":
                for key in ("tokens", "token_logprobs", "top_logprobs"):
                    slot[key] += lp[key]
            else:
                slot["content"] += lp["content"]
    return joined


# ------------------------------------------------------------------ end to end


CASES = [
    pytest.param([500], 5, 42, id="original-issue-shape"),
    pytest.param(REQUESTED, 3, 42, id="sampled-outside-set"),
    pytest.param(REQUESTED, 3, 500, id="sampled-inside-set"),
]


@pytest.mark.parametrize("endpoint", ALL)
@pytest.mark.parametrize(("requested", "top_k", "sampled"), CASES)
def test_returns_exactly_the_sampled_token_plus_the_requested_ids(live_server, endpoint, requested, top_k, sampled):
    # vLLM: tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py::test_logprob_token_ids_returns_requested_ids
    body = ok(post(live_server, endpoint, body_for(endpoint, top_k, requested, max_tokens=1, temperature=0,
                                                   allowed_token_ids=[sampled])))  # fmt: skip
    expected_choices = 2 if endpoint == "chat_batch" else 1
    assert len(body["choices"]) == expected_choices
    for choice in body["choices"]:
        assert assert_exactly_sampled_plus(endpoint, choice["logprobs"], requested, 1) == [sampled]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_sdk_top_k_is_decoupled_from_explicit_token_ids(live_server, endpoint):
    # vLLM: tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py::test_chat_request_decouples_top_k_from_explicit_token_ids
    # (and ::test_completion_request_decouples_top_k_from_explicit_token_ids): top 5 asked, 1 id -> 2 listed
    client = openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    extra = {"logprob_token_ids": [500], "allowed_token_ids": [FORCED], "return_tokens_as_token_ids": True}
    if endpoint == "chat":
        r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=1, temperature=0, logprobs=True,
                                           top_logprobs=5, extra_body=extra)  # fmt: skip
        entry = r.choices[0].logprobs.content[0]
        assert token_id(entry.token) == FORCED
        assert sorted(token_id(t.token) for t in entry.top_logprobs) == [FORCED, 500]
    else:
        r = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=1, temperature=0, logprobs=5,
                                      extra_body=extra)  # fmt: skip
        lp = r.choices[0].logprobs
        assert [token_id(t) for t in lp.tokens] == [FORCED]
        assert sorted(token_id(t) for t in lp.top_logprobs[0]) == [FORCED, 500]


@pytest.mark.parametrize("endpoint", STREAMING)
def test_stream_with_no_top_k(live_server, endpoint):
    # vLLM: tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py::test_logprob_token_ids_stream_with_no_top_k
    body = body_for(endpoint, None, [500], max_tokens=1, temperature=0, allowed_token_ids=[FORCED], stream=True)
    if endpoint == "chat":
        body["top_logprobs"] = None  # null means "not set"
    r = post(live_server, endpoint, body)
    assert r.status_code == 200, r.text
    joined = stream_logprobs(endpoint, r.text)
    assert sorted(joined) == [0]
    assert assert_exactly_sampled_plus(endpoint, joined[0], [500], 1) == [FORCED]


@pytest.mark.parametrize("endpoint", STREAMING)
def test_every_position_of_every_choice_streamed_or_not(live_server, endpoint):
    # vLLM: tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py::test_logprob_token_ids_returns_requested_ids
    # extended to every generated position of n = 3 sampled choices, streamed and not (same seed: same tokens)
    sampling = dict(max_tokens=4, temperature=1.0, seed=11, n=3, ignore_eos=True)
    final = ok(post(live_server, endpoint, body_for(endpoint, 2, REQUESTED, **sampling)))
    assert [c["index"] for c in final["choices"]] == [0, 1, 2]
    streamed = post(live_server, endpoint, body_for(endpoint, 2, REQUESTED, stream=True, **sampling))
    assert streamed.status_code == 200, streamed.text
    joined = stream_logprobs(endpoint, streamed.text)
    assert sorted(joined) == [0, 1, 2]
    for choice in final["choices"]:
        sampled = assert_exactly_sampled_plus(endpoint, choice["logprobs"], REQUESTED, 4)
        assert assert_exactly_sampled_plus(endpoint, joined[choice["index"]], REQUESTED, 4) == sampled
        if endpoint == "generate":
            assert sampled == choice["token_ids"]
        assert_same_positions(endpoint, joined[choice["index"]], choice["logprobs"])


@pytest.mark.parametrize("endpoint", ["chat", "completions", "generate"])
def test_default_behavior_unchanged(live_server, endpoint):
    # vLLM: tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py::test_logprob_token_ids_default_behavior_unchanged
    body = ok(post(live_server, endpoint, body_for(endpoint, 5, None, max_tokens=1, temperature=0)))
    (sampled, lp, listed), = positions(endpoint, body["choices"][0]["logprobs"])
    # greedy: the sampled token is the most likely, so "k best" and "k best plus the sampled" agree: 5 entries
    assert len(listed) == 5
    values = sorted((v for _, v in listed), reverse=True)
    assert all(v <= 0.0 for v in values)
    assert dict(listed)[sampled] == pytest.approx(lp)
    assert lp == pytest.approx(values[0])


# ------------------------------------------------------------------ validation


def with_logprobs(endpoint: str, state: str) -> dict:
    """``state``: "absent", "off" (false / null) or "on" (true / a count) for ``endpoint``'s logprobs field."""
    if state == "absent":
        return {}
    if endpoint in ("chat", "chat_batch"):
        return {"logprobs": state == "on"}
    return {"logprobs": 2 if state == "on" else None}


def bare_body(endpoint: str, **fields) -> dict:
    if endpoint == "generate":
        return {"token_ids": PROMPT_IDS, "sampling_params": {"max_tokens": 1, **fields}}
    if endpoint == "completions":
        return {"prompt": "hi", "max_tokens": 1, **fields}
    if endpoint == "chat":
        return {"messages": MSG, "max_tokens": 1, **fields}
    return {"messages": [MSG], "max_tokens": 1, **fields}


@pytest.mark.parametrize("endpoint", ALL)
@pytest.mark.parametrize("logprobs", ["absent", "off", "on"])
def test_rejects_empty_token_ids(live_server, endpoint, logprobs):
    # vLLM: tests/entrypoints/openai/chat_completion/test_logprob_token_ids_validation.py::test_rejects_empty_token_ids
    r = post(live_server, endpoint, bare_body(endpoint, logprob_token_ids=[], **with_logprobs(endpoint, logprobs)))
    refused(r, param_name(endpoint, "logprob_token_ids"))


@pytest.mark.parametrize("endpoint", ALL)
@pytest.mark.parametrize("logprobs", ["absent", "off"])
def test_rejects_token_ids_without_logprobs(live_server, endpoint, logprobs):
    # vLLM: tests/entrypoints/openai/chat_completion/test_logprob_token_ids_validation.py::test_rejects_token_ids_without_logprobs
    r = post(live_server, endpoint, bare_body(endpoint, logprob_token_ids=[100], **with_logprobs(endpoint, logprobs)))
    error = refused(r, param_name(endpoint, "logprob_token_ids"))
    assert "logprobs" in error["message"]


@pytest.mark.parametrize("endpoint", ALL)
@pytest.mark.parametrize("value", [123, "123"])
def test_rejects_non_list(live_server, endpoint, value):
    # vLLM: tests/entrypoints/openai/chat_completion/test_logprob_token_ids_validation.py::test_defers_non_list_to_pydantic
    r = post(live_server, endpoint, bare_body(endpoint, logprob_token_ids=value, **with_logprobs(endpoint, "on")))
    refused(r, param_name(endpoint, "logprob_token_ids"))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_rejects_explicit_token_ids_with_beam_search(live_server, endpoint):
    # vLLM: tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py::test_requests_reject_explicit_token_ids_with_beam_search
    r = post(live_server, endpoint, bare_body(endpoint, logprob_token_ids=[100], use_beam_search=True,
                                              **with_logprobs(endpoint, "on")))  # fmt: skip
    error = refused(r, "logprob_token_ids")
    assert "beam" in error["message"]


def test_completion_rejects_explicit_token_ids_without_generated_tokens(live_server):
    # vLLM: tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py::test_completion_rejects_explicit_token_ids_without_generated_tokens
    r = post(live_server, "completions", {"prompt": "Hello", "echo": True, "max_tokens": 0, "logprobs": 5,
                                          "logprob_token_ids": [500]})  # fmt: skip
    refused(r, "logprob_token_ids")
    # the same request generating one token is fine, and lists the ids at that position only
    body = ok(post(live_server, "completions", {"prompt": "Hello", "echo": True, "max_tokens": 1, "logprobs": 5,
                                                "logprob_token_ids": [500], "return_tokens_as_token_ids": True}))  # fmt: skip
    lp = body["choices"][0]["logprobs"]
    sampled = token_id(lp["tokens"][-1])
    assert {token_id(t) for t in lp["top_logprobs"][-1]} == {sampled, 500}
