"""`gyrfalcon check`'s own parts: the registry, what counts as a refusal, stream framing, reports.
(Its checks run against live servers in tests/live/test_check.py.)"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from gyrfalcon.check import Outcome, Result, Target, selected
from gyrfalcon.check.registry import ENDPOINTS, Broken, Unsupported
from gyrfalcon.check.report import line, summary, to_json, to_junit
from gyrfalcon.check.semantics.stream_shape import expect_choices, read_stream
from gyrfalcon.check.target import Reply, accepted, refused


def reply(status: int, body, content_type: str = "application/json") -> Reply:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Reply("POST", "/v1/completions", {}, status, {"content-type": content_type}, raw, "curl ...")


def sse(*events) -> Reply:
    text = "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)
    return reply(200, text.encode(), "text/event-stream")


def chunk(index: int, text: str, finish: str | None = None) -> dict:
    return {"id": "c1", "object": "text_completion", "choices": [{"index": index, "text": text, "finish_reason": finish}]}


def test_every_check_is_named_once_documented_and_grouped():
    checks = selected([g for g in ENDPOINTS if g != "schema"])
    assert len(checks) >= 60
    assert len({c.name for c in checks}) == len(checks)
    assert all(c.doc and c.endpoint in ENDPOINTS and c.name.startswith(c.endpoint + ".") for c in checks)
    assert {c.endpoint for c in selected(["chat"])} == {"chat"}
    with pytest.raises(ValueError, match="unknown endpoint group"):
        selected(["nope"])


def test_a_refusal_must_be_a_400_naming_the_param():
    refused(reply(400, {"error": {"message": "bad", "type": "BadRequestError", "param": "n"}}), "n")
    refused(reply(400, {"error": {"message": "bad", "param": "messages.0.role"}}), "messages")  # a path inside it
    with pytest.raises(Broken, match="error.param is None"):
        refused(reply(400, {"detail": "bad"}), "n")
    with pytest.raises(Broken, match="error.param is 'messages_x'"):
        refused(reply(400, {"error": {"message": "bad", "param": "messages_x"}}), "messages")
    with pytest.raises(Broken, match="accepted"):
        refused(reply(200, {}), "n")
    with pytest.raises(Broken, match="500"):
        refused(reply(500, b"Internal Server Error", "text/plain"), "n")
    with pytest.raises(Unsupported):
        refused(reply(404, {"detail": "Not Found"}), "n")  # the route itself is missing


def test_accepted_tells_a_loud_refusal_from_a_breakage():
    assert accepted(reply(200, {})).status == 200
    for status in (400, 404, 422, 501):
        with pytest.raises(Unsupported):
            accepted(reply(status, {"error": {"message": "no"}}))
    with pytest.raises(Broken):
        accepted(reply(500, b"oops", "text/plain"))


def test_stream_framing():
    stream = read_stream(sse(chunk(0, "a"), chunk(1, "b"), chunk(0, "c", "stop"), chunk(1, "", "length"), "[DONE]"))
    expect_choices(stream, 2)
    assert stream.text == {0: "ac", 1: "b"} and stream.finishes == {0: ["stop"], 1: ["length"]}
    with pytest.raises(Broken, match=r"\[DONE\]"):
        read_stream(sse(chunk(0, "a", "stop")))
    with pytest.raises(Broken, match="2 choices"):
        read_stream(sse({"id": "c1", "choices": [chunk(0, "a")["choices"][0], chunk(1, "b")["choices"][0]]}, "[DONE]"))
    with pytest.raises(Broken, match="after its finish_reason"):
        read_stream(sse(chunk(0, "a", "stop"), chunk(0, "b"), "[DONE]"))
    with pytest.raises(Broken, match="indices"):
        expect_choices(read_stream(sse(chunk(0, "a", "stop"), "[DONE]")), 2)
    with pytest.raises(Broken, match="not text/event-stream"):
        read_stream(reply(200, {"choices": []}))


def test_curl_lines_reproduce_without_the_key():
    target = Target("http://127.0.0.1:9/prefix", api_key="sk-secret")
    curl = target._curl("POST", "/v1/completions", json.dumps({"prompt": "it's"}).encode())
    assert curl.startswith("curl ") and "http://127.0.0.1:9/prefix/v1/completions" in curl
    assert "sk-secret" not in curl and "$API_KEY" in curl and "it'\"'\"'s" in curl
    with pytest.raises(ValueError):
        Target("ftp://example")


def test_reports():
    one, two, three, four = selected(["models"])[:4]
    results = [Result(one, Outcome.PASSED, seconds=0.1), Result(two, Outcome.FAILED, "n=4 gave [0]", "curl -d x", 0.2),
               Result(three, Outcome.UNSUPPORTED, "404"), Result(four, Outcome.INCONCLUSIVE, "one answer only")]  # fmt: skip
    assert "FAIL" in line(results[1]) and "reproduce: curl -d x" in line(results[1])
    assert line(results[3]).startswith("INCONCLUSIVE") and "one answer only" in line(results[3])
    assert "1 unsupported, 1 inconclusive" in summary(results)
    suite = ET.fromstring(to_junit(results, "http://x"))
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("4", "1", "2")
    failure = suite.find("testcase/failure")
    assert failure is not None and "curl -d x" in failure.text
    assert [s.get("message") for s in suite.iter("skipped")] == ["unsupported: 404", "inconclusive: one answer only"]
    data = json.loads(to_json(results, "http://x", "tiny"))
    assert data["summary"] == {"passed": 1, "failed": 1, "unsupported": 1, "inconclusive": 1}
    assert data["checks"][1]["reproduce"] == "curl -d x"


def test_a_server_that_cannot_be_reached_is_an_error_not_a_failure():
    import socket

    from gyrfalcon.check import run_check

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the check runs: nothing listens there
    result = run_check(Target(f"http://127.0.0.1:{port}", model_name="m"), selected(["models"])[0])
    assert result.outcome is Outcome.ERROR and "ConnectionRefused" in result.message


def test_the_schema_phase_caps_the_tokens_of_valid_cases():
    from gyrfalcon.contract import cap_tokens

    chat = {"max_completion_tokens": 900, "max_tokens": 5, "n": 700}
    cap_tokens(chat, 16, absent_means_context=True)
    assert chat == {"max_completion_tokens": 16, "max_tokens": 5, "n": 2}
    floor = {"max_tokens": 500, "min_tokens": 20}  # never below min_tokens, so the case stays valid
    cap_tokens(floor, 16, absent_means_context=False)
    assert floor == {"max_tokens": 20, "min_tokens": 20}
    whole_float = {"min_tokens": 241.0}  # the fuzz campaign's two ST202s before this was read
    cap_tokens(whole_float, 16, absent_means_context=True)
    assert whole_float == {"min_tokens": 241.0, "max_tokens": 241}
    unset = {}
    cap_tokens(unset, 16, absent_means_context=True)  # chat's "up to the context" becomes 16
    assert unset == {"max_tokens": 16}
    completions = {}
    cap_tokens(completions, 16, absent_means_context=False)  # completions' default is 16 already
    assert completions == {}


class Answering(Target):
    """A target whose server is a function of (path, body) → (status, JSON body): the checker's own
    logic under answers no real model gives on demand."""

    def __init__(self, answer) -> None:
        super().__init__("http://127.0.0.1:9", model_name="m")
        self.answer = answer

    def request(self, method, path, body=None, raw=None, peek=False) -> Reply:
        status, payload = self.answer(path, body or {})
        self.replies.append(Reply(method, path, body, status, {"content-type": "application/json"},
                                  json.dumps(payload).encode(), "curl ..."))  # fmt: skip
        return self.replies[-1]


def _choices(texts, logprob=None):
    lp = lambda: {"tokens": ["x"] * 16, "token_logprobs": [logprob] * 16, "top_logprobs": [{}] * 16}  # noqa: E731
    return {"choices": [{"index": i, "text": t, "finish_reason": "length", **({"logprobs": lp()} if logprob is not None else {})}
                        for i, t in enumerate(texts)]}  # fmt: skip


def _check(name: str):
    return next(c for c in selected(["completions"]) if c.name == name)


def test_a_model_that_offers_no_stop_string_is_inconclusive_not_a_failure():
    from gyrfalcon.check import run_check

    result = run_check(Answering(lambda path, body: (200, _choices(["eeeeeeeeeeeeeeee"]))), _check("completions.stop_string_cuts"))
    assert result.outcome is Outcome.INCONCLUSIVE and "no stop string can be chosen" in result.message
    # a server that ignores the stop string it was given is still caught
    sampled = lambda path, body: (200, _choices(["eeee" if body["temperature"] == 0 else "abcdef"]))  # noqa: E731
    result = run_check(Answering(sampled), _check("completions.stop_string_cuts"))
    assert result.outcome is Outcome.FAILED and "stop 'bc'" in result.message


def test_four_equal_samples_fail_only_where_the_models_logprobs_make_them_unlikely():
    from gyrfalcon.check import run_check

    def server(logprob):
        return lambda path, body: (200, _choices(["same"] * body["n"], logprob if "logprobs" in body else None))

    one_answer = run_check(Answering(server(-0.001)), _check("completions.n_choices_are_samples_of_their_own"))
    assert one_answer.outcome is Outcome.INCONCLUSIVE and "one answer is what this model says" in one_answer.message
    copied = run_check(Answering(server(-2.0)), _check("completions.n_choices_are_samples_of_their_own"))
    assert copied.outcome is Outcome.FAILED and "copies of one sample" in copied.message
    refused = lambda path, body: (400, {"error": {"message": "no logprobs"}}) if "logprobs" in body else server(None)(path, body)  # noqa: E731
    unknown = run_check(Answering(refused), _check("completions.n_choices_are_samples_of_their_own"))
    assert unknown.outcome is Outcome.INCONCLUSIVE


def test_a_server_that_refuses_the_responses_api_loudly_does_not_offer_it():
    """A model without a chat template cannot render a Responses request's input: its 400 naming
    input is a loud refusal (unsupported), not a broken promise."""
    from gyrfalcon.check import run_check

    def base_model(path, body):
        return 400, {"error": {"message": "The chat template cannot render these messages", "param": "input"}}

    checks = [c for c in selected(["responses"]) if "refusals_name_their_field" not in c.name]
    assert checks
    for one in checks:
        assert run_check(Answering(base_model), one).outcome is Outcome.UNSUPPORTED, one.name


def test_token_ids_come_from_the_server():
    from gyrfalcon.check.semantics.ids import server_ids

    def tokenizer(path, body):
        return (200, {"tokens": [5, 9, 5, 12, 30, 31, 7, 8]}) if path == "/tokenize" else (404, {})

    ids = server_ids(Answering(tokenizer))
    assert ids.prompt == [5, 9, 5, 12, 30, 31, 7] and ids.watched == [30, 31, 7, 8] and ids.source == "POST /tokenize"

    def completions_only(path, body):
        if path != "/v1/completions":
            return 404, {}
        return 200, {"choices": [{"index": 0, "text": "x", "prompt_token_ids": [3, 4, 5, 6, 7, 8], "token_ids": [9, 3]}]}

    target = Answering(completions_only)
    assert server_ids(target).prompt == [3, 4, 5, 6, 7, 8, 9] and not target.replies  # the search leaves no reply behind
    nothing = server_ids(Answering(lambda path, body: (404, {})))
    assert nothing.prompt == list(range(7)) and "smallest" in nothing.source


def test_a_server_that_is_not_gyrfalcon_is_held_to_what_openai_requires_of_responses():
    from gyrfalcon.check.schema import OPENAI_REQUIRED, builtin_spec

    spec = builtin_spec(Answering(lambda path, body: (404, {})))
    schemas = spec["components"]["schemas"]
    assert schemas["ModelCard"]["required"] == ["id", "object", "created", "owned_by"]  # no vLLM "root"
    for name, required in OPENAI_REQUIRED.items():
        assert set(required) <= set(schemas[name]["properties"]), name
    assert spec["x-limits"]["vocab_size"] == 256


def test_chat_tokens_that_are_halves_of_characters_are_told_apart_by_their_bytes():
    from gyrfalcon.check.semantics.flavours import CHAT

    entry = {"token": "\ufffd", "logprob": -1.0, "bytes": [129], "top_logprobs": [
        {"token": "\ufffd", "logprob": -1.0, "bytes": [129]}, {"token": "\ufffd", "logprob": -1.5, "bytes": [167]}]}
    ((token, logprob, top),) = CHAT.positions({"logprobs": {"content": [entry]}})
    assert len(top) == 2 and top[token] == logprob == -1.0  # two tokens, and the chosen one found among them


def _junit(cases: dict[str, str | None]) -> str:
    """A Schemathesis JUnit report: one test case per operation, with its failure message (None: passed)."""
    rows = "".join(f'<testcase name="{name}">' + (f'<failure message="{message}">trace</failure>' if message else "")
                   + "</testcase>" for name, message in cases.items())  # fmt: skip
    return f'<testsuite name="schemathesis">{rows}</testsuite>'


def test_schemathesis_reporting_its_own_error_as_a_bare_error_element_is_not_blamed_on_the_server(monkeypatch):
    """Schemathesis also reports an error of its own as ``<error>`` with the kind at the start of its
    text and no ``message`` attribute (two clean-clone CI runs: "Runtime Error … Inconsistent
    results" while generating the generate endpoint's cases): that too is run once more, not a
    failure of the server."""
    import subprocess

    from gyrfalcon.check import schema

    runs: list[str] = []
    reports = [
        '<testsuite><testcase name="POST /inference/v1/generate"><error type="error">Runtime Error\n\nInconsistent results'
        '</error></testcase><testcase name="POST /tokenize"/></testsuite>',
        '<testsuite><testcase name="POST /inference/v1/generate"/></testsuite>',
    ]

    def schemathesis(cmd, **_):
        runs.append(cmd[cmd.index("--include-path-regex") + 1])
        with open(cmd[cmd.index("--report-junit-path") + 1], "w") as f:
            f.write(reports[len(runs) - 1])
        return subprocess.CompletedProcess(cmd, 1, "", "")

    monkeypatch.setattr(schema.subprocess, "run", schemathesis)
    monkeypatch.setattr(schema, "builtin_spec", lambda target: {})
    results = {r.check.name: r for r in schema.run_schema(Answering(lambda path, body: (400, {})), {"schema"})}
    assert runs[1] == r"(^/inference/v1/generate$)"
    assert results["schema.POST /inference/v1/generate"].outcome is Outcome.PASSED
    assert results["schema.POST /tokenize"].outcome is Outcome.PASSED


def test_schemathesis_failing_in_itself_is_run_again_and_never_blamed_on_the_server(monkeypatch):
    """A case Schemathesis could not even generate (its JUnit "Runtime Error", as in a CI run where its
    coverage phase raised inside Hypothesis) is no finding about the server: the operation runs once
    more, and a second such error is an error of the run, not a failure. A check that found a
    response wrong stays a failure."""
    import subprocess

    from gyrfalcon.check import schema

    runs: list[str] = []
    answers = [
        {"POST /inference/v1/generate": "Runtime Error&#10;&#10;Inconsistent results", "POST /tokenize": None,
         "POST /v1/completions": "1. Server error"},
        {"POST /inference/v1/generate": None},
        {"POST /inference/v1/generate": "Runtime Error&#10;&#10;Inconsistent results", "POST /tokenize": None},
        {"POST /inference/v1/generate": "Runtime Error&#10;&#10;RecursionError"},
    ]

    def schemathesis(cmd, **_):
        runs.append(cmd[cmd.index("--include-path-regex") + 1])
        with open(cmd[cmd.index("--report-junit-path") + 1], "w") as f:
            f.write(_junit(answers[len(runs) - 1]))
        return subprocess.CompletedProcess(cmd, 1, "", "")

    monkeypatch.setattr(schema.subprocess, "run", schemathesis)
    monkeypatch.setattr(schema, "builtin_spec", lambda target: {})
    target = Answering(lambda path, body: (400, {}))  # every route is there (no operation is "missing")
    first = {r.check.name: r for r in schema.run_schema(target, {"schema"})}
    assert runs[1] == r"(^/inference/v1/generate$)"  # once more, that operation only
    assert first["schema.POST /inference/v1/generate"].outcome is Outcome.PASSED
    assert first["schema.POST /v1/completions"].outcome is Outcome.FAILED  # a finding stays one
    assert first["schema.POST /tokenize"].outcome is Outcome.PASSED
    again = {r.check.name: r for r in schema.run_schema(target, {"schema"})}
    crashed = again["schema.POST /inference/v1/generate"]
    assert crashed.outcome is Outcome.ERROR and "Schemathesis failed in itself" in crashed.message
    assert "RecursionError" in crashed.message and len(runs) == 4
