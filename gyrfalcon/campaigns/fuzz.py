"""Schemathesis against a running server's own spec, positive and negative, every check, with the
runtime rules of :mod:`gyrfalcon.contract`: ``max_examples`` per operation (the campaign: 1,000).

Target: no failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass


@dataclass
class FuzzReport:
    max_examples: int
    returncode: int
    summary: str
    max_tokens: int = 0

    def met(self) -> bool:
        return self.returncode == 0

    def lines(self) -> list[str]:
        cap = f", valid cases capped at {self.max_tokens} new tokens" if self.max_tokens else ""
        return [f"Schemathesis, {self.max_examples} examples per operation, all checks, both modes{cap}:", self.summary]


def run(url: str, max_examples: int = 1000, workers: int = 2, seed: int = 1, request_timeout: float = 300,
        max_tokens: int = 16) -> FuzzReport:  # fmt: skip
    """``max_tokens``: valid cases ask for at most this many new tokens (0: as generated); long
    generations cost minutes each on a CPU and add nothing to what a case tests of the contract."""
    from gyrfalcon.contract import MAX_TOKENS_ENV

    cmd = [sys.executable, "-m", "schemathesis.cli", "run", url.rstrip("/") + "/openapi.json", "--checks", "all",
           "--mode", "all", "--max-examples", str(max_examples), "--seed", str(seed), "--workers", str(workers),
           "--generation-database", "none", "--output-sanitize", "false",
           # a real model on a CPU takes longer than Schemathesis's 10 s for the largest valid requests
           "--request-timeout", str(request_timeout), "--max-response-time", str(request_timeout)]  # fmt: skip
    env = dict(os.environ, SCHEMATHESIS_HOOKS="gyrfalcon.contract", **{MAX_TOKENS_ENV: str(max_tokens)})
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    out = result.stdout
    if result.returncode != 0:  # the failures themselves, with their reproductions
        summary = out[-6000:] + result.stderr[-2000:]
    else:
        summary = "\n".join(_phases(out) + _summary(out)) or out[-3000:]
    return FuzzReport(max_examples, result.returncode, summary, max_tokens)


def _phases(out: str) -> list[str]:
    """Each phase's heading with its time, and the count under it ("✅ 1000 passed")."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    heading = re.compile(r"^\S+\s+(Examples|Coverage|Fuzzing|Stateful) \(in [^)]*\)$")
    return [f"{ln}: {lines[i + 1]}" for i, ln in enumerate(lines[:-1]) if heading.match(ln)]


def _summary(out: str) -> list[str]:
    """Schemathesis's summary: operations selected and tested, phases, cases, the verdict."""
    start = out.find("API Operations:")
    if start < 0:
        return re.findall(r"^\s*(\d+ generated.*|No issues found.*|.*failures? in .*)$", out, re.M)
    return [ln.rstrip() for ln in out[start:].splitlines() if ln.strip() and not ln.startswith("Seed:")]
