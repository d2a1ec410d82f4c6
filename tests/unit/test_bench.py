"""`gyrfalcon bench` without a server: random weights, the ceilings, the report's target lines, the options."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from gyrfalcon.bench.ceiling import CeilingResult
from gyrfalcon.bench.client import LoadReport, Result


def _args(*argv: str) -> argparse.Namespace:
    from gyrfalcon.bench.run import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _prompts(batch: int, length: int = 8) -> list[list[int]]:
    return [[10 + (7 * i + 3 * j) % 400 for j in range(length)] for i in range(batch)]


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from gyrfalcon.bench.ceiling import load

    return load(tiny_model_dir, "auto", 1, "cpu")


def test_random_weights_folder_loads_and_covers_the_tokenizer(tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoTokenizer

    from gyrfalcon.bench.weights import build_timed, folder_name
    from gyrfalcon.models.loading import load_model

    with open(f"{tiny_model_dir}/config.json") as f:
        config = json.load(f)
    config.update(vocab_size=300, eos_token_id=999, num_hidden_layers=3)  # smaller than the tokenizer, eos outside it
    config_file = tmp_path / "shape" / "config.json"
    config_file.parent.mkdir()
    config_file.write_text(json.dumps(config))

    assert folder_name(config_file) == "random-shape"
    out, seconds = build_timed(str(config_file), tiny_model_dir, str(tmp_path / "built"), "cpu", "auto")
    assert seconds > 0
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert len(tokenizer) == len(AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)) == 512
    model = load_model(out, "auto", "cpu")
    assert model.dtype == torch.float32
    assert model.config.num_hidden_layers == 3  # the config's shape, not the tokenizer folder's model
    assert model.config.vocab_size >= len(tokenizer)
    assert model.get_input_embeddings().weight.shape[0] >= len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id == 2
    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()


def test_eager_ceiling_reports_consistent_figures(tiny_model):
    from gyrfalcon.bench.ceiling import bare_loop

    result = bare_loop(tiny_model, _prompts(3), 6)
    assert (result.batch, result.new_tokens) == (3, 6)
    assert result.prefill_s > 0 and result.decode_s > 0
    assert result.time_per_step == pytest.approx(result.decode_s / 5)
    assert result.output_tokens_per_s == pytest.approx(18 / (result.prefill_s + result.decode_s))
    assert result.compile_s is None


def test_static_cache_loop_is_not_ended_by_eos(tiny_model_dir):
    """Random weights may emit eos at once: the static-cache loop must still make every token it times."""
    import torch

    from gyrfalcon.bench.ceiling import compiled_loop, load

    model = load(tiny_model_dir, "auto", 1, "cpu")
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()  # equal logits: greedy picks id 0 ...
    model.generation_config.eos_token_id = 0  # ... which is now eos
    result = compiled_loop(model, _prompts(2), 5, compile=False)  # raises if generate stopped early
    assert (result.batch, result.new_tokens, result.compile_s) == (2, 5, None)
    assert result.prefill_s > 0 and result.decode_s >= 0
    assert math.isfinite(result.time_per_step)


def _load(concurrency: int, tok_per_s: float, tpot: float, requests: int = 4, tokens: int = 10) -> LoadReport:
    """A fabricated load: ``requests`` results of ``tokens`` tokens each, TPOT ``tpot``, at ``tok_per_s``."""
    results = [Result(ttft=0.1, latency=0.1 + tpot * (tokens - 1), output_tokens=tokens) for _ in range(requests)]
    return LoadReport(concurrency, requests * tokens / tok_per_s, results)


def _ceiling(batch: int, tok_per_s: float, step: float, tokens: int = 10, compile_s: float | None = None) -> CeilingResult:
    total = batch * tokens / tok_per_s
    decode = step * (tokens - 1)
    return CeilingResult(batch, tokens, total - decode, decode, compile_s)


def test_cpu_report_prints_the_cpu_targets():
    from gyrfalcon.bench.report import table

    loads = [_load(1, 10.0, 0.102), _load(16, 97.0, 0.15)]
    eager = {1: _ceiling(1, 11.0, 0.100), 16: _ceiling(16, 100.0, 0.14)}
    n_cmp = {"n": 8, "n_request_s": 2.0, "sequential_s": 10.0, "ratio": 0.2}
    memory = {"requests": 1000, "rss_before": 100 * 2**20, "rss_after": 101 * 2**20, "growth": 0.01, "errors": 0}
    text = table(loads, eager, {}, n_cmp, memory, "cpu")
    assert "- c=16 output tok/s / eager ceiling at batch 16: 0.97 (target ≥ 0.95: met)" in text
    assert "- c=1 TPOT p50 / eager step at batch 1: 1.02 (target ≤ 1.05: met)" in text
    assert "- n=8 request 2.00 s / 8 sequential n=1 requests 10.00 s: 0.20 (target ≤ 0.25: met)" in text
    assert "growth 1.0 % (target < 5 %)" in text
    assert "compiled" not in text  # no compiled columns or lines when it did not run
    header, rule, *rows = text.split("\n\n")[0].splitlines()
    assert header.count("|") == rule.count("|") == rows[0].count("|") == 10
    assert rows[1].startswith("| 16 | ") and "| 0.97 |" in rows[1]


def test_cpu_report_prints_the_fp32_baseline_and_the_peer_with_their_targets():
    from gyrfalcon.bench.report import figures, table

    loads = [_load(1, 40.0, 0.025), _load(16, 200.0, 0.08)]
    eager = {1: _ceiling(1, 45.0, 0.022), 16: _ceiling(16, 210.0, 0.075)}
    baseline = {1: _ceiling(1, 16.0, 0.06), 16: _ceiling(16, 95.0, 0.15)}
    peer = [_load(1, 41.0, 0.024), _load(16, 36.0, 0.025)]
    text = table(loads, eager, {}, None, None, "cpu", baseline=baseline, peer=peer)
    assert "- c=1 output tok/s / fp32 eager loop at batch 1: 2.50 (target ≥ 4: missed)" in text
    assert "- c=16 output tok/s / fp32 eager loop at batch 16: 2.11 (target ≥ 2: met)" in text
    assert "- c=1 output tok/s / the peer's: 0.98 (target ≥ 1: missed)" in text
    assert "- c=16 output tok/s / the peer's: 5.56 (target ≥ 1.5: met)" in text
    header, rule, *rows = text.split("\n\n")[0].splitlines()
    assert "fp32 loop tok/s" in header and "peer tok/s" in header
    assert header.count("|") == rule.count("|") == rows[0].count("|") == 15
    assert "| 95.0 | 2.11 | 36.0 | 25.0 | 5.56 |" in rows[1]
    data = figures("cpu", loads, eager, {}, None, None, baseline=baseline, peer_loads=peer)
    assert data["peer_loads"][1]["tok_per_s"] == pytest.approx(36.0) and data["baseline_ceilings"][16]["tok_per_s"] == pytest.approx(95.0)
    met = {t["label"] for t in data["targets"] if t["met"]}
    assert {"c=16 output tok/s / fp32 eager loop at batch 16", "c=16 output tok/s / the peer's"} <= met
    assert not {"c=1 output tok/s / fp32 eager loop at batch 1", "c=1 output tok/s / the peer's"} & met


def test_a_peer_that_is_the_same_server_with_more_options_gets_its_speed_up_not_llama_servers_targets():
    from gyrfalcon.bench.report import figures, table

    loads, peer = [_load(1, 100.0, 0.007)], [_load(1, 171.0, 0.003)]
    variant = "--speculative-config '{\"method\": \"ngram\"}'"
    text = table(loads, {}, {}, None, None, "cpu", peer=peer, variant=variant)
    assert f"- c=1: output tok/s with {variant} / without: 1.71" in text and "the peer's" not in text
    data = figures("cpu", loads, {}, {}, None, None, peer_loads=peer, variant=variant)
    assert data["variant_ratios"] == {1: pytest.approx(1.71)} and data["targets"] == []
    same = table(loads, {}, {}, None, None, "cpu", peer=peer, variant="")  # the same options: an A/A run
    assert "- c=1: output tok/s with no more options / without: 1.71" in same and "the peer's" not in same


def test_cpu_report_prints_only_ratios_it_has_both_figures_of():
    from gyrfalcon.bench.report import table

    text = table([_load(1, 10.0, 0.2), _load(4, 30.0, 0.2)], {1: _ceiling(1, 11.0, 0.1)}, None, None, None, "cpu")
    assert "- c=1 TPOT p50 / eager step at batch 1: 2.00 (target ≤ 1.05: missed)" in text
    assert "c=16" not in text and "n=8" not in text


def test_cuda_report_prints_the_cuda_targets_and_compile_times():
    from gyrfalcon.bench.report import figures, table

    loads = [_load(1, 200.0, 0.004), _load(64, 9000.0, 0.0056)]
    eager = {1: _ceiling(1, 60.0, 0.0156), 64: _ceiling(64, 2600.0, 0.0243)}
    compiled = {1: _ceiling(1, 290.0, 0.00336, compile_s=29.0), 64: _ceiling(64, 12869.0, 0.00497, compile_s=41.0)}
    n_cmp = {"n": 8, "n_request_s": 1.0, "sequential_s": 4.0, "ratio": 0.25}
    text = table(loads, eager, compiled, n_cmp, None, "cuda", None, 3 * 2**30)
    assert "- c=64 output tok/s / compiled ceiling at batch 64: 0.70 (target ≥ 0.8: missed)" in text
    assert "- c=1 TPOT p50 / compiled step at batch 1: 1.19 (target ≤ 1.3: met)" in text
    assert "- c=64 TPOT p50 / c=1 TPOT p50: 1.40 (target ≤ 1.5: met)" in text
    assert "0.25 (target ≤ 0.2: missed)" in text
    assert "29.0 s at batch 1, 41.0 s at batch 64" in text
    assert "peak device memory of the ceilings: 3.00 GiB" in text
    assert "eager ceiling at batch" not in text  # the CPU targets are not the GPU's
    assert "| 64 | " in text and "| 12869.0 | 4.97 |" in text
    data = json.loads(json.dumps(figures("cuda", loads, eager, compiled, n_cmp, None, wall_s=1.0)))
    assert [t["met"] for t in data["targets"]] == [False, True, True, False]
    assert data["compiled_ceilings"]["64"]["compile_s"] == 41.0 and data["wall_s"] == 1.0


def test_a_compile_failure_keeps_the_report():
    from gyrfalcon.bench.report import table

    text = table([_load(1, 200.0, 0.004)], {1: _ceiling(1, 60.0, 0.0156)}, {}, None, None, "cuda", "at batch 1: RuntimeError: boom")
    assert "- compiled ceiling failed: at batch 1: RuntimeError: boom" in text
    assert text.startswith("| concurrency |")


def test_a_failing_compile_leaves_the_eager_ceilings(tiny_model_dir, monkeypatch):
    import gyrfalcon.bench.ceiling as ceiling
    from gyrfalcon.bench.ceiling import run_ceilings
    from gyrfalcon.bench.run import resolve_options

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler\nlong traceback")

    monkeypatch.setattr(ceiling, "compiled_loop", broken)
    args = _args("--launch", "--compiled-ceiling", "--concurrency", "1", "2", "--output-tokens", "3", "--prompt-tokens", "8")
    assert resolve_options(args, "cpu") is None
    out = run_ceilings(tiny_model_dir, args, "cpu", _prompts(2))
    assert sorted(out["eager"]) == [1, 2] and out["compiled"] == {} and out["peak_memory"] is None
    assert out["compiled_error"] == "at batch 1: RuntimeError: no C++ compiler"


def test_device_defaults_and_validation():
    from gyrfalcon.bench.run import requests_at, resolve_options

    cpu = _args("--launch")
    assert resolve_options(cpu, "cpu") is None
    assert (cpu.concurrency, cpu.mixed, cpu.compiled_ceiling, cpu.dtype) == ([1, 4, 16], 1000, False, "auto")
    assert [requests_at(cpu, c, "cpu") for c in cpu.concurrency] == [64, 64, 64]
    cuda = _args("--launch")
    assert resolve_options(cuda, "cuda") is None
    assert (cuda.concurrency, cuda.mixed, cuda.compiled_ceiling) == ([1, 16, 64], 0, True)
    assert [requests_at(cuda, c, "cuda") for c in [1, 16, 64, 128]] == [16, 32, 128, 256]
    forced = _args("--launch", "--no-compiled-ceiling", "--mixed", "5", "--concurrency", "128", "--requests", "3")
    assert resolve_options(forced, "cuda") is None
    assert (forced.compiled_ceiling, forced.mixed, requests_at(forced, 128, "cuda")) == (False, 5, 3)

    assert "--concurrency must be in 1..128, got 129" in resolve_options(_args("--launch", "--concurrency", "1", "129"), "cpu")
    assert "--concurrency must be in 1..128" in resolve_options(_args("--launch", "--concurrency", "0"), "cpu")
    assert "give --url or --launch" in resolve_options(_args(), "cpu")
    assert "not both" in resolve_options(_args("--launch", "--model", "m", "--random-weights", "c.json"), "cpu")
    assert "no such file" in resolve_options(_args("--launch", "--random-weights", "does/not/exist.json"), "cpu")
    assert "--output-tokens must be at least 2" in resolve_options(_args("--launch", "--output-tokens", "1"), "cpu")
    spec = "--speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'"
    assert resolve_options(_args("--launch", "--peer-serve-args", spec), "cpu") is None
    for refused in (_args("--url", "http://127.0.0.1:9", "--peer-serve-args", spec),
                    _args("--launch", "--peer-url", "http://127.0.0.1:9", "--peer-serve-args", spec)):  # fmt: skip
        assert "--peer-serve-args goes with --launch" in resolve_options(refused, "cpu")
    with pytest.raises(SystemExit):
        _args("--launch", "--dtype", "float8")


def test_bench_refuses_a_bad_level_before_starting_anything(capsys):
    from gyrfalcon.bench.run import main

    assert main(_args("--launch", "--device", "cpu", "--concurrency", "129")) == 2
    assert "--concurrency must be in 1..128" in capsys.readouterr().err


def test_serve_command_line_makes_room_for_every_level_and_passes_extra_options():
    from gyrfalcon.bench.server import serve_argv

    argv = serve_argv(8001, "m", "cuda", "auto", 1, 64, "")
    assert argv[1:4] == ["-m", "gyrfalcon.cli", "serve"]
    as_pairs = dict(zip(argv[4::2], argv[5::2]))
    assert as_pairs == {"--port": "8001", "--device": "cuda", "--dtype": "auto", "--num-threads": "1", "--model": "m",
                        "--max-num-seqs": "64", "--max-queue-len": "128"}  # fmt: skip
    extra = _args("--launch", "--serve-args", "--max-num-seqs 128 --max-num-batched-tokens=8192 --served-model-name 'a b'")
    argv = serve_argv(8001, None, "cpu", "auto", 1, 16, extra.serve_args)
    assert argv.count("--max-num-seqs") == 1 and argv[argv.index("--max-num-seqs") + 1] == "128"
    assert argv[-5:] == ["--max-num-seqs", "128", "--max-num-batched-tokens=8192", "--served-model-name", "a b"]
    assert "--model" not in argv and argv[argv.index("--max-queue-len") + 1] == "64"


def test_a_failing_warm_up_stops_the_run_with_the_server_log():
    import http.server
    import threading

    from gyrfalcon.bench.client import Client
    from gyrfalcon.bench.run import warm_up

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(503)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"busy")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    class Launched:
        def log_tail(self):
            return "engine: something broke"

    try:
        with pytest.raises(RuntimeError, match=r"warm-up request failed: HTTP 503.*\n.*engine: something broke"):
            warm_up(Client(f"http://127.0.0.1:{httpd.server_port}", timeout=5), "m", _prompts(2), 2, Launched())
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_server_that_closes_each_connection_after_a_stream_loses_no_request():
    """llama-server closes the connection after each streamed answer without saying so: the next
    request on that kept-alive connection is sent again on a new one, once (the warm-up failed at
    once against it); a request the server refuses is not sent twice."""
    import http.server
    import threading

    from gyrfalcon.bench.client import Client, run_load

    seen: list[str] = []

    class Closing(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(body.decode())
            if b"refuse" in body:
                self.send_response(400)
                self.send_header("Content-Length", "3")
                self.end_headers()
                self.wfile.write(b"bad")
                return
            events = b'data: {"choices": [{"text": "hi"}]}\n\ndata: [DONE]\n\n'
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(events)))
            self.end_headers()
            self.wfile.write(events)
            self.close_connection = True  # and no "Connection: close" header

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Closing)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = Client(f"http://127.0.0.1:{httpd.server_port}", timeout=5)
        report = run_load(client, [{"model": "m", "prompt": f"p{i}", "max_tokens": 2} for i in range(5)], 1)
        assert report.errors == 0 and len(report.results) == 5
        assert sorted(json.loads(body)["prompt"] for body in seen) == [f"p{i}" for i in range(5)]
        seen.clear()
        report = run_load(client, [{"model": "m", "prompt": "ok", "max_tokens": 2}, {"model": "m", "prompt": "refuse"}], 1)
        assert report.errors == 1 and len(seen) == 2
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_each_level_and_the_warm_up_send_prompts_no_other_sent():
    """A level served from the prompt cache an earlier level filled measures the cache, not serving."""
    from gyrfalcon.bench.client import fresh_prompts

    warm, levels = fresh_prompts([3, 5, 16], 16, 32, 49152, seed=0)
    assert [len(level) for level in levels] == [3, 5, 16] and len(warm) == 16
    every = [tuple(p) for p in warm] + [tuple(p) for level in levels for p in level]
    assert len(set(every)) == len(every) == 40
    assert all(len(p) == 32 and all(100 <= t < 49152 for t in p) for p in every)


def test_the_plot_draws_each_level_of_both_servers():
    import xml.etree.ElementTree as ET

    from gyrfalcon.bench.plot import svg

    drawn = svg([1, 4, 16], {"gyrfalcon": [88.0, 200.5, 288.5], "peer": [81.8, 150.0, 167.9]}, "CPU <AVX2> & 2 threads")
    root = ET.fromstring(drawn)  # well-formed, the caption escaped
    ns = "{http://www.w3.org/2000/svg}"
    lines = root.findall(f"{ns}polyline")
    assert len(lines) == 2
    ours = [tuple(map(float, p.split(","))) for p in lines[0].get("points").split()]
    assert len(ours) == 3 and ours[0][0] < ours[1][0] < ours[2][0] and ours[0][1] > ours[1][1] > ours[2][1]
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert {"c=1", "c=4", "c=16", "288.5", "167.9", "gyrfalcon", "peer"} <= set(texts)
    assert any("CPU <AVX2> & 2 threads" in (t or "") for t in texts)
