"""`gyrfalcon serve` refuses a bad setting with one clear line, before starting anything."""

from __future__ import annotations

import subprocess
import sys

import pytest

BAD = [
    (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
    (["--max-model-len", "1"], "--max-model-len must be at least 2"),
    (["--dtype", "float8"], "--dtype must be one of"),
    (["--quantization", "gptq"], "--quantization must be one of auto, none, int4, int8, got 'gptq'"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype must be one of float32, bfloat16, float16, auto, got 'fp8'"),
    (["--model", "does/not/exist"], "no such file or folder"),
    (["--port", "70000"], "--port must be in 1..65535"),
    (["--engine", "nope"], "--engine 'nope' is not installed"),
    (["--seed", "-1"], "--seed must be in"),
    (["--block-size", "0"], "--block-size must be at least 1"),
    (["--kv-cache-memory", "0"], "--kv-cache-memory must be a positive number of bytes"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_setting_is_one_clear_line(args, message):
    out = subprocess.run([sys.executable, "-m", "gyrfalcon.cli", "serve", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], out.stderr
