"""``python -m gyrfalcon.bench.gpu_check``: the GPU acceptance run, one command from a source checkout.

On any CUDA machine with torch ≥ 2.11 (nothing compiled, the project on ``PYTHONPATH``, no weights
to fetch: ``PYTHONPATH=. python -m gyrfalcon.bench.gpu_check``):

1. random weights of SmolLM2-1.7B's shape (:data:`SMOLLM2_1_7B`, or ``--config CONFIG.json``) with the
   default model's tokenizer (or ``--tokenizer DIR``), built on the device;
2. ``gyrfalcon serve`` on them: the decode path its ``/health`` reports, and the contract smoke — the
   checks of ``gyrfalcon check`` for all ``n`` choices, exact ``logprob_token_ids`` and seeds
   (:data:`SMOKE`);
3. ``gyrfalcon bench --launch`` on the same folder: c=1/16/64 against the compiled static-cache loop
   measured in the same run, with the GPU targets.

The exit code is 0 when every smoke check passed, the bench ran, and on CUDA the decode steps are
captured (a server that fell back to eager prints why, and the run fails); the bench's targets are
printed met or missed. ``--device cpu`` runs the same on a tiny shape (:data:`TINY`) with small
loads: what a CPU test runs, so the command itself is proven wherever the suite runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

#: SmolLM2-1.7B's shape (its Hugging Face config, without weights): the GPU runs' model
SMOLLM2_1_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 130000, "vocab_size": 49152, "tie_word_embeddings": True,
    "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}  # fmt: skip
#: a tiny shape of the same family, for ``--device cpu`` (the vocabulary widens to the tokenizer's)
TINY = {**SMOLLM2_1_7B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 1024, "vocab_size": 256}  # fmt: skip
#: the contract smoke: every choice of n, exactly the logprobs asked by id, reproducible seeds
SMOKE = (
    "completions.n_choices", "chat.n_choices", "completions.stream_n_choices", "generate.n_choices",
    "completions.logprob_token_ids_exact", "completions.logprob_token_ids_exact_streamed",
    "chat.logprob_token_ids_exact", "generate.logprob_token_ids_exact",
    "completions.seed_reproducible", "chat.stream_equals_non_stream", "generate.seed_reproducible",
)  # fmt: skip


def _say(text: str) -> None:
    print(text, flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gyrfalcon.bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (the acceptance run) or cpu (the same command on a tiny shape)")
    p.add_argument("--config", default=None, help="a Hugging Face config.json instead of the built-in shape")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the embedded default model's)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="bench levels (cuda: 1 16 64; cpu: 1 4)")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default: the bench's; cpu: 4)")
    p.add_argument("--output-tokens", type=int, default=None, help="tokens per request (cuda: 128; cpu: 16)")
    p.add_argument("--serve-args", default="", help="more `gyrfalcon serve` options for both servers, one string")
    p.add_argument("--json", default=None, help="also write the bench's figures and the smoke's outcomes here")
    return p.parse_args(argv)


def smoke(url: str) -> list:
    """The :data:`SMOKE` checks against ``url``; their results."""
    from gyrfalcon.check import Target, run_check, selected
    from gyrfalcon.check.report import line

    target = Target(url, timeout=300.0)
    checks = [c for c in selected() if c.name in SMOKE]
    assert len(checks) == len(SMOKE), sorted(set(SMOKE) - {c.name for c in checks})
    results = []
    for one in checks:
        results.append(run_check(target, one))
        _say(line(results[-1]))
    return results


def _start_up_line(log_path: str, name: str) -> str | None:
    """What the server's start-up line ``name: …`` says (the engine logs its choices so)."""
    with open(log_path, errors="replace") as f:
        for line in f:  # "[time] [pid] [WARNING] engine: attention: flex (…)"
            _, sep, said = line.strip().partition(f"] engine: {name}: ")
            if sep:
                return said
    return None


def _random_model(args, cuda: bool, workdir: str) -> str:
    """Random weights of the run's shape (``--config``, else SmolLM2-1.7B's on CUDA, a tiny one
    elsewhere) with the tokenizer of ``--tokenizer`` (else the default model's); returns their folder."""
    from gyrfalcon.bench.weights import build_timed
    from gyrfalcon.models.default import resolve_model

    config = args.config
    if config is None:
        config = os.path.join(workdir, "SmolLM2-1.7B-shape" if cuda else "tiny-shape", "config.json")
        os.makedirs(os.path.dirname(config))
        with open(config, "w") as f:
            json.dump(SMOLLM2_1_7B if cuda else TINY, f)
    tokenizer = args.tokenizer or resolve_model(None, None)
    model, build_s = build_timed(config, tokenizer, os.path.join(workdir, "model"), args.device, "auto")
    _say(f"random weights of {config} built in {build_s:.1f} s")
    return str(model)


def _serve_and_smoke(args, model: str, extra: str, concurrency: list[int], workdir: str):
    """Serve ``model``; returns its decode path, its attention and the contract smoke's results."""
    from gyrfalcon.bench.client import Client
    from gyrfalcon.bench.run import decode_path
    from gyrfalcon.bench.server import launch, serve_argv
    from gyrfalcon.check import Outcome

    log_path = os.path.join(workdir, "serve.log")
    server = launch(lambda port: serve_argv(port, model, args.device, "auto", 2, max(concurrency), extra), log_path)
    try:
        path = decode_path(Client(server.url)) or "not reported"
        _say(f"decode path: {path}")
        attention = _start_up_line(log_path, "attention") or "not reported"
        _say(f"attention: {attention}")
        results = smoke(server.url)
    finally:
        server.stop()
    _say(f"contract smoke: {sum(r.outcome is Outcome.PASSED for r in results)} of {len(results)} passed")
    return path, attention, results


def _bench(args, cuda: bool, model: str, extra: str, concurrency: list[int], workdir: str) -> tuple[int, dict]:
    """``gyrfalcon bench --launch`` on ``model``; returns its exit status and its JSON report."""
    figures = os.path.join(workdir, "bench.json")
    output_tokens = args.output_tokens or (128 if cuda else 16)
    bench = [sys.executable, "-m", "gyrfalcon.cli", "bench", "--launch", "--model", model, "--device", args.device,
             "--concurrency", *map(str, concurrency), "--output-tokens", str(output_tokens), "--json", figures,
             "--serve-args", extra]  # fmt: skip
    if not cuda:
        bench += ["--requests", str(args.requests or 4), "--mixed", "0", "--n", "0"]
    elif args.requests:
        bench += ["--requests", str(args.requests)]
    _say(f"bench: {' '.join(bench[2:])}")
    ran = subprocess.run(bench)
    report = {}
    if ran.returncode == 0 and os.path.exists(figures):
        with open(figures) as f:
            report = json.load(f)
    return ran.returncode, report


def _report(args, cuda: bool, path: str, attention: str, results, bench_status: int, report: dict, started: float) -> int:
    """Print the acceptance summary (and write ``--json``); 1 when anything failed."""
    from gyrfalcon.check import Outcome

    passed = sum(r.outcome is Outcome.PASSED for r in results)
    problems = [f"smoke: {r.check.name} {r.outcome.value}: {r.message}" for r in results if r.outcome is not Outcome.PASSED]
    if bench_status != 0:
        problems.append(f"the bench exited with {bench_status}")
    if cuda and not path.startswith("captured"):
        problems.append(f"decode steps are not captured: {path}")
    if cuda and not attention.startswith("flex"):
        problems.append(f"attention does not read the KV blocks in place: {attention}")
    _say("\n## GPU acceptance" if cuda else "\n## Acceptance run (CPU, tiny shape)")
    _say(f"- decode path: {path}")
    _say(f"- attention: {attention}")
    _say(f"- contract smoke: {passed} of {len(results)} passed")
    for t in report.get("targets", []):
        _say(f"- {t['label']}: {t['value']:.2f} (target {t['op']} {t['target']:g}: {'met' if t['met'] else 'missed'})")
    _say(f"- total wall time {time.perf_counter() - started:.0f} s")
    for problem in problems:
        _say(f"FAILED: {problem}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"decode_path": path, "attention": attention, "smoke": {r.check.name: r.outcome.value for r in results},
                       "bench": report, "problems": problems}, f, indent=2)  # fmt: skip
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cuda = args.device.startswith("cuda")
    if cuda:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: torch sees no CUDA device (run with --device cpu to prove the command here)", file=sys.stderr)
            return 2
    concurrency = args.concurrency or ([1, 16, 64] if cuda else [1, 4])
    started = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="gyrfalcon-gpu-check-")
    try:
        model = _random_model(args, cuda, workdir)
        extra = f"--max-model-len 1024 {args.serve_args}"
        path, attention, results = _serve_and_smoke(args, model, extra, concurrency, workdir)
        bench_status, report = _bench(args, cuda, model, extra, concurrency, workdir)
        return _report(args, cuda, path, attention, results, bench_status, report, started)
    except RuntimeError as exc:  # a server that did not start, a request that failed
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
