"""`gyrfalcon check URL` run as its docs say: against gyrfalcon itself (every check passes, on a model
with a vocabulary under 400 and on one whose greedy text repeats one token: the checker never
accuses a correct server of what its model does), against a gyrfalcon with a planted fault and
against `transformers serve` (each found without being told), and as a pytest plugin inside
another suite."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.live_server import free_port, start_server, stop_server

pytestmark = [pytest.mark.live]

ROOT = Path(__file__).resolve().parents[2]


#: under 400 tokens: fixed ids such as 401 would be refused (correctly), so every id a check sends
#: must come from the server
SMALL_VOCABULARY = 382


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The tiny model with a small vocabulary and room for tool prompts (2,048 positions)."""
    from gyrfalcon.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("check-model"), vocab_size=SMALL_VOCABULARY, positions=2048))


@pytest.fixture(scope="module")
def repeating_model_dir(tmp_path_factory) -> str:
    """The tiny model edited so that its greedy text is "eeee…" (the token "e" gets a margin at every
    position), while sampled text stays varied. The edit is in the weights rather than a logits
    processor: the server's logprobs are the model's own, so greedy still picks their top token."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from gyrfalcon.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("repeating-model"), positions=2048)
    token = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("e")
    weights = load_file(path / "model.safetensors")
    embeddings, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    embeddings[:, 0] = 8 * embeddings.std()  # one coordinate of the stream, the same sign everywhere …
    head[:, 0] = 0
    head[token, 0] = 0.7  # … read by "e" alone
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def _serve(model_dir: str, log: Path, *extra: str, env: dict | None = None):
    args = ["--model", model_dir, "--served-model-name", "tiny", "--max-model-len", "2048", "--num-threads", "1",
            "--dtype", "float32", *extra]  # fmt: skip
    return start_server(args, str(log), env=env)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    live = _serve(model_dir, tmp_path_factory.mktemp("check") / "server.log")
    yield live
    stop_server(live)


def gyrfalcon_check(url: str, report: Path, *options: str) -> tuple[int, dict, str]:
    """Run the command line; return its exit code, its JSON report and its printed report."""
    done = subprocess.run([sys.executable, "-m", "gyrfalcon.cli", "check", url, "--report", "json", "--report-path",
                           str(report), *options], capture_output=True, text=True, timeout=600)  # fmt: skip
    return done.returncode, json.loads(report.read_text()), done.stdout + done.stderr


def outcomes(report: dict) -> dict[str, str]:
    return {c["name"]: c["outcome"] for c in report["checks"]}


def test_every_check_passes_against_gyrfalcon(server, tmp_path):
    """The whole run, as CI would: exit code 0, a JUnit report with every semantic check and the
    Schemathesis operations, none failed or skipped."""
    import xml.etree.ElementTree as ET

    from gyrfalcon.check import selected

    semantic = selected([g for g in ("models", "completions", "chat", "batch", "generate", "errors")])
    assert len(semantic) >= 60
    junit = tmp_path / "r.xml"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gyrfalcon.cli", "check", server.url, "--report", "junit",
                           "--report-path", str(junit)], capture_output=True, text=True, timeout=600)  # fmt: skip
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    suite = ET.parse(junit).getroot()
    assert (suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("0", "0", "0"), done.stdout[-6000:]
    names = {case.get("name") for case in suite.iter("testcase")}
    assert {c.name for c in semantic} <= names
    schema = [n for n in names if n.startswith("schema.")]
    assert any("/v1/completions" in n for n in schema) and any("/v1/chat/completions" in n for n in schema), schema
    print(f"gyrfalcon check: {len(names)} checks ({len(semantic)} semantic) passed in {elapsed:.1f} s")


def test_no_check_fails_when_greedy_text_repeats_one_token(repeating_model_dir, tmp_path):
    """A model whose greedy answer is sixteen "e"s (no stop string can be chosen from it): the
    semantic checks find what they need in other answers, and none fails or is skipped."""
    live = _serve(repeating_model_dir, tmp_path / "server.log")
    try:
        greedy = requests.post(live.url + "/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 16,
                                                                   "temperature": 0}, timeout=60).json()  # fmt: skip
        code, report, printed = gyrfalcon_check(live.url, tmp_path / "r.json", "--only",
                                                "models,completions,chat,batch,generate,errors")  # fmt: skip
    finally:
        stop_server(live)
    assert greedy["choices"][0]["text"] == "e" * 16, greedy
    assert code == 0, printed[-6000:]
    assert set(outcomes(report).values()) == {"passed"}, printed[-6000:]


def test_an_api_key_reaches_every_phase_and_no_command_line(model_dir, tmp_path):
    """A server behind an API key, the key given as the docs say (``$GYRFALCON_CHECK_API_KEY``):
    both phases authenticate, and no process's command line shows the key while they run."""
    key = "sk-check-${HOME}-7"  # "${" is Schemathesis's placeholder syntax: it must pass through as is
    live = _serve(model_dir, tmp_path / "server.log", env={"GYRFALCON_API_KEY": key})  # not on its command line either
    report, printed = tmp_path / "r.json", tmp_path / "printed.txt"
    try:
        with open(printed, "w") as out:
            checker = subprocess.Popen([sys.executable, "-m", "gyrfalcon.cli", "check", live.url, "--only", "models,schema",
                                        "--examples", "3", "--report", "json", "--report-path", str(report)],
                                       stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, GYRFALCON_CHECK_API_KEY=key))  # fmt: skip
        ran_schemathesis, shown = False, []
        while checker.poll() is None:
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmdline = f.read()
                except OSError:
                    continue
                ran_schemathesis |= b"schemathesis.cli" in cmdline
                if key.encode() in cmdline:
                    shown.append(cmdline)
            time.sleep(0.05)
    finally:
        stop_server(live)
    printed = printed.read_text()
    assert checker.returncode == 0, printed[-6000:]
    assert ran_schemathesis, printed[-3000:]
    assert not shown, shown
    results = outcomes(json.loads(report.read_text()))
    assert any(name.startswith("schema.GET /v1/models") for name in results), results
    assert set(results.values()) == {"passed"}, printed[-6000:]


@pytest.mark.parametrize("model", ["model_dir", "repeating_model_dir"])
def test_planted_echo_shift_is_found(request, model, tmp_path):
    """A server whose echo logprobs are one position late (a test-only plugin): the checker names
    the echo checks, and only checks that read prompt logprobs fail — on both models."""
    model_dir = request.getfixturevalue(model)
    site = tmp_path / "site"
    info = site / "planted_faults-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: planted-faults\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[gyrfalcon]\nplanted = tests.planted_faults\n")
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    live = _serve(model_dir, tmp_path / "server.log", "--plugins-block", "gyrfalcon.plugins.logprobs", env=env)
    try:
        code, report, printed = gyrfalcon_check(live.url, tmp_path / "r.json", "--only", "completions")
    finally:
        stop_server(live)
    failed = {name for name, o in outcomes(report).items() if o == "failed"}
    assert code == 1, printed[-4000:]
    assert any(name.startswith("completions.echo_logprobs_at_their_positions") for name in failed), printed[-4000:]
    assert failed <= {n for n in outcomes(report) if "echo" in n or "prompt_logprobs" in n}, failed


def _transformers_serve() -> str | None:
    exe = shutil.which("transformers") or os.path.join(os.path.dirname(sys.executable), "transformers")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        return None
    return exe if os.path.exists(exe) else None


def test_transformers_serve_collapsing_n_is_found(model_dir, tmp_path):
    """`transformers serve` answers n > 1 with one choice: the checker reports it as broken."""
    exe = _transformers_serve()
    if exe is None:
        pytest.skip("transformers serve needs fastapi and uvicorn (transformers[serving])")
    port = free_port()
    log = open(tmp_path / "transformers.log", "wb")
    process = subprocess.Popen([exe, "serve", model_dir, "--host", "127.0.0.1", "--port", str(port)], stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert process.poll() is None, (tmp_path / "transformers.log").read_text()[-3000:]
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(0.5)
        code, report, printed = gyrfalcon_check(url, tmp_path / "r.json", "--only", "completions")
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # it may still be generating what a check hung up on
        process.wait(timeout=30)
    results = {c["name"]: c for c in report["checks"]}
    assert code == 1
    n_choices = results["completions.n_choices"]
    assert n_choices["outcome"] == "failed" and "n=4 gave choice indices [0]" in n_choices["message"], n_choices
    assert n_choices["reproduce"].startswith("curl ") and '"n": 4' in n_choices["reproduce"]


def test_as_a_pytest_plugin(server, tmp_path):
    """`pytest --gyrfalcon-url URL` in another project's suite: one test per check."""
    from gyrfalcon.check import selected

    done = subprocess.run([sys.executable, "-m", "pytest", "--gyrfalcon-url", server.url, "--gyrfalcon-only", "completions",
                           "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:]
    assert f"{len(selected(['completions']))} passed" in done.stdout, done.stdout[-2000:]
