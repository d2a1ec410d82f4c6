"""``examples/rl_loop.py``, two steps, against a server it starts on a tiny model: rollouts through
generate, the trainer's logprobs equal to the server's, new weights pushed between a pause and a
resume, and the next step's rollouts made by them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_rl_loop_example_runs_two_steps_on_the_weights_it_pushes():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--steps", "2"], capture_output=True,
                            text=True, timeout=600, cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2, result.stdout
    assert steps[0].endswith("rollouts made by default") and steps[1].endswith("rollouts made by step-1"), steps
    assert float(result.stdout.rsplit("gap over 2 steps: ", 1)[1]) <= 1e-5, result.stdout
