"""The Schemathesis phase: positive and negative cases for every operation of the contract, every
check Schemathesis has, with gyrfalcon's runtime-rule hooks (:mod:`gyrfalcon.contract`).

``builtin`` is gyrfalcon's own contract, narrowed to the target's deployment so that "valid"
means valid there (:func:`builtin_spec`); ``served`` is the target's own ``/openapi.json``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

from gyrfalcon.check.registry import Check, Outcome, Result
from gyrfalcon.check.target import API_KEY_ENV, Target

#: the operations of each endpoint group (Schemathesis's path filter)
PATHS = {
    "models": r"^/(v1/models|health|version|tokenize|detokenize|metrics|openapi\.json)$",
    "completions": r"^/v1/completions$",
    "chat": r"^/v1/chat/completions$",
    "batch": r"^/v1/chat/completions/batch$",
    "generate": r"^/inference/v1/generate$",
}


#: the bounds assumed of a server that does not publish gyrfalcon's ``x-limits``: ids every
#: vocabulary has, a context every chat model has
ASSUMED = {"vocab_size": 256, "max_model_len": 2048, "max_request_seqs": 16}
#: capabilities a deployment may lack by design (beam search, priority scheduling, SGLang's fields):
#: the generic contract pins their fields to the defaults, as a gyrfalcon deployment without them does
PINNED = frozenset({"use_beam_search", "priority", "store", "no_stop_trim", "return_hidden_states", "reasoning_parser"})


#: what OpenAI's own API reference requires of its responses, where gyrfalcon's contract requires
#: more (vLLM's extensions: ``stop_reason``, ``token_ids``, a model card's ``root``…): a server that is
#: not gyrfalcon is held to OpenAI's list, never accused of lacking an extension
OPENAI_REQUIRED = {
    "ModelCard": ["id", "object", "created", "owned_by"],
    "CompletionResponse": ["id", "object", "created", "model", "choices"],
    "CompletionStreamResponse": ["id", "object", "created", "model", "choices"],
    "CompletionChoice": ["index", "text", "logprobs", "finish_reason"],
    "ChatCompletionResponse": ["id", "object", "created", "model", "choices"],
    "ChatCompletionStreamResponse": ["id", "object", "created", "model", "choices"],
    "ChatCompletionChoice": ["index", "message", "logprobs", "finish_reason"],
    "ChatCompletionStreamChoice": ["index", "delta", "finish_reason"],
    "ChatResponseMessage": ["role", "content"],
    "ChatToolCallDelta": ["index"],
}


def builtin_spec(target: Target) -> dict:
    """gyrfalcon's contract for ``target``.

    A gyrfalcon server serves that contract narrowed to its deployment (its limits, its engine's
    capabilities, its chat template: ``x-limits`` and ``x-runtime-rules`` say so), which is used as
    it is. For any other server: the bundled documents with the model's name, the bounds in
    :data:`ASSUMED`, the :data:`PINNED` fields at their defaults, and responses required to hold
    what OpenAI requires (:data:`OPENAI_REQUIRED`)."""
    from gyrfalcon.engine_api.limits import ServedLimits
    from gyrfalcon.openapi.served import bundle, request_field_names, served_spec
    from gyrfalcon.protocol.runtime_rules import served_table
    from gyrfalcon.protocol.capabilities import capability_of

    served = target.get("/openapi.json")
    if served.status == 200 and served.headers.get("content-type", "").startswith("application/json"):
        document = served.json if isinstance(served.json, dict) else {}
        if "x-limits" in document and "x-runtime-rules" in document:
            return document
    pinned = {f for f in request_field_names(bundle()) if capability_of(f) in PINNED}
    spec = served_spec(ServedLimits(model_names=[target.model], unsupported=pinned, **ASSUMED), served_table())
    spec["x-limits"] = {"chat": None, "kv_cache": None, **ASSUMED}
    for name, required in OPENAI_REQUIRED.items():
        spec["components"]["schemas"][name]["required"] = required
    return spec


def run_schema(target: Target, only: set[str], spec: str = "builtin", max_examples: int = 10, workers: int = 2,
               max_tokens: int = 16) -> list[Result]:  # fmt: skip
    """One result per operation Schemathesis tested (its JUnit report read back), over the operations
    of ``only``'s endpoint groups (every operation when none of them has one); positive cases ask
    for at most ``max_tokens`` new tokens (:mod:`gyrfalcon.contract`'s ``before_call``)."""
    started = time.monotonic()
    try:
        import schemathesis  # noqa: F401
    except ImportError:
        return [_error("Schemathesis is not installed: pip install 'gyrfalcon[check]'", started)]
    with tempfile.TemporaryDirectory(prefix="gyrfalcon-check-") as tmp:
        if spec == "served":
            location = target.url.rstrip("/") + "/openapi.json"
        else:
            location = os.path.join(tmp, "openapi.json")
            with open(location, "w") as f:
                json.dump(builtin_spec(target), f)
        junit = os.path.join(tmp, "junit.xml")
        groups = [g for g in sorted(only) if g in PATHS] or sorted(PATHS)  # "schema" alone: every operation
        pattern = "|".join(f"({PATHS[g]})" for g in groups)
        from gyrfalcon.contract import MAX_TOKENS_ENV

        env = dict(os.environ, SCHEMATHESIS_HOOKS="gyrfalcon.contract", **{MAX_TOKENS_ENV: str(max_tokens)})
        env.pop(API_KEY_ENV, None)
        config = []
        if target.api_key:
            # in a file only this user reads: a command line is everyone's to read, and the server's
            # rule holds here too (no key in a child's environment)
            config = ["--config-file", os.path.join(tmp, "schemathesis.toml")]
            with os.fdopen(os.open(config[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                value = "Bearer " + target.api_key.replace("${", "$${")  # "${" starts a placeholder there
                f.write(f"headers = {{ Authorization = {json.dumps(value, ensure_ascii=False)} }}\n")

        def run(pattern: str) -> list[Result]:
            cmd = [sys.executable, "-m", "schemathesis.cli", *config, "run", location, "--url", target.url.rstrip("/"),
                   "--checks", "all", "--mode", "all", "--max-examples", str(max_examples), "--seed", "1",
                   "--workers", str(workers), "--generation-database", "none", "--include-path-regex", pattern,
                   "--request-timeout", "120", "--max-response-time", "120", "--report", "junit",
                   "--report-junit-path", junit]  # fmt: skip
            if target.insecure:
                cmd += ["--tls-verify", "false"]
            if os.path.exists(junit):
                os.unlink(junit)
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if not os.path.exists(junit):
                return [_error((done.stdout[-1500:] + done.stderr[-1500:]).strip(), started)]
            return _results(ET.parse(junit).getroot(), target)

        results = run(pattern)
        crashed = [r.check.name for r in results if r.outcome is Outcome.ERROR and r.check.name != "schema.run"]
        if crashed:  # Schemathesis's own error, not the server's: once more for those operations
            again = {r.check.name: r for r in run("|".join(_path_pattern(name) for name in crashed))}
            results = [again.get(r.check.name, r) for r in results]
        return results


def _path_pattern(check_name: str) -> str:
    """The path filter of one operation's check (``schema.POST /tokenize`` → ``^/tokenize$``)."""
    return "(^" + re.escape(check_name.partition(" ")[2]) + "$)"


#: how Schemathesis's JUnit report begins a failure that is its own error, not a check's
SCHEMATHESIS_ERROR = "Runtime Error"


def _error(message: str, started: float) -> Result:
    one = Check("schema.run", "schema", (), "The Schemathesis phase runs", lambda t: None)
    return Result(one, Outcome.ERROR, message, "", time.monotonic() - started)


def _results(root: ET.Element, target: Target) -> list[Result]:
    results = []
    for case in root.iter("testcase"):
        name = case.get("name", "?")
        # an <error> of Schemathesis's own (a non-fatal error of the run) has no message attribute: its
        # text begins with the kind ("Runtime Error"), so each problem is read stripped
        problems = [((e.get("message") or "") + "\n" + (e.text or "")).strip() for e in case if e.tag in ("failure", "error")]
        doc = f"Schemathesis, positive and negative cases, every check: {name}"
        one = Check(f"schema.{name}", "schema", (), doc, lambda t: None)
        if any(e.tag == "skipped" for e in case) and not problems:
            continue
        outcome = Outcome.FAILED if problems else Outcome.PASSED
        message = "\n".join(p.strip() for p in problems)
        reproduce = ""
        missing = _missing_route(target, name) if problems else None
        if missing:
            outcome, message = Outcome.UNSUPPORTED, missing
        elif problems and all(p.startswith(SCHEMATHESIS_ERROR) for p in problems):
            # Schemathesis failed in itself (generating cases, say): no response was found wrong, so
            # the server is not accused; the end of the traceback says what broke
            outcome = Outcome.ERROR
            message = f"Schemathesis failed in itself, not on a response of the server:\n…{message[-3000:]}"
            reproduce = f"gyrfalcon check {target.url} --only schema"
        elif problems:
            message = message[:4000]
            curls = [ln.strip() for ln in message.splitlines() if ln.strip().startswith("curl ")]
            reproduce = curls[0] if curls else f"gyrfalcon check {target.url} --only schema"
        results.append(Result(one, outcome, message, reproduce, float(case.get("time") or 0)))
    return results


def _missing_route(target: Target, operation: str) -> str | None:
    """The server lacks the operation (``"POST /tokenize"``) altogether: its route answers 404 or 405."""
    method, _, path = operation.partition(" ")
    if method not in ("GET", "POST") or not path.startswith("/"):
        return None
    reply = target.request(method, path, {} if method == "POST" else None)
    return f"{operation}: the route is missing ({reply.status})" if reply.status in (404, 405) else None

