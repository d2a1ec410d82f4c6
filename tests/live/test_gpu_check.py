"""The GPU acceptance command (`python -m gyrfalcon.bench.gpu_check`) run as a CPU test: the same
steps on a tiny shape, so the command a CUDA machine runs is proven wherever the suite runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.live]


def test_the_acceptance_command_runs_on_the_cpu(tiny_model_dir, tmp_path):
    out = tmp_path / "acceptance.json"
    done = subprocess.run([sys.executable, "-m", "gyrfalcon.bench.gpu_check", "--device", "cpu", "--tokenizer", tiny_model_dir,
                           "--json", str(out), "--serve-args", "--attention-backend flex"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["problems"] == [] and report["decode_path"].startswith("eager"), report
    # the GPU's attention (auto there), asked for here: the KV blocks read in place, checked at start-up
    assert report["attention"] == "flex (the KV blocks read in place)", report
    assert len(report["smoke"]) == 11 and set(report["smoke"].values()) == {"passed"}, report["smoke"]
    loads = {load["concurrency"]: load for load in report["bench"]["loads"]}
    assert set(loads) == {1, 4} and all(load["errors"] == 0 and load["tok_per_s"] > 0 for load in loads.values())
    assert "## Acceptance run (CPU, tiny shape)" in done.stdout and "decode path: eager" in done.stdout
