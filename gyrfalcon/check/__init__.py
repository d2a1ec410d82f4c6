"""``gyrfalcon check URL``: the contract an OpenAI-compatible server keeps, checked from outside.

Two phases: Schemathesis against gyrfalcon's OpenAPI contract (:mod:`gyrfalcon.check.schema`), and
the semantic checks a schema cannot state (:mod:`gyrfalcon.check.semantics`): all ``n`` choices,
exact ``logprob_token_ids``, echo logprobs at their positions, reproducible seeds, stream framing,
nulls, 400s naming their param. Each check says what it needs; a server that refuses a feature
loudly is "unsupported" there, one that accepts and does something else "failed".

The same checks run from pytest (``pytest --gyrfalcon-url URL``, :mod:`gyrfalcon.check.pytest_plugin`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gyrfalcon.check.registry import CHECKS, ENDPOINTS, Check, Outcome, Result
from gyrfalcon.check.runner import run_check, run_checks
from gyrfalcon.check.semantics import selected
from gyrfalcon.check.target import Target

__all__ = ["CHECKS", "ENDPOINTS", "Check", "Outcome", "Result", "Target", "check_server", "run_check", "selected"]


def check_server(target: Target, only: Iterable[str] | None = None, spec: str = "builtin", max_examples: int = 10,
                 progress: Callable[[Result], None] | None = None, max_tokens: int = 16) -> list[Result]:  # fmt: skip
    """Every selected semantic check, then (when ``schema`` is selected) the Schemathesis phase."""
    groups = set(only or ENDPOINTS)
    results = run_checks(target, selected(groups - {"schema"}), progress)
    if "schema" in groups:
        from gyrfalcon.check.schema import run_schema

        for result in run_schema(target, groups, spec, max_examples, max_tokens=max_tokens):
            results.append(result)
            if progress:
                progress(result)
    return results
