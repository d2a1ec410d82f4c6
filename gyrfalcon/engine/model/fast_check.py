"""The fast decode step's self-check: which path decode steps take and why, and the comparison of a
fast step (a CUDA graph, a compiled step) with the eager one on the same inputs
(:mod:`~gyrfalcon.engine.model.captured` runs them)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

#: how far two forwards' logits may be apart, relative to the largest logit (at least 1), by the
#: coarsest rounding of their inputs (the model's dtype, or the quantised matmuls' input format:
#: :func:`~gyrfalcon.kernels.quant.apply.matmul_inputs`): fp32 reassociation moves the tiny
#: model's by 6e-8; inputs rounded to int8 per block turn a last-bit difference between two
#: forwards into a whole step of the block's grid now and then (the default model's direct and
#: transformers forwards: 0.34 on logits near 20)
FAST_STEP_RTOL = {torch.float32: 1e-4, torch.int16: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.int8: 5e-2}


@dataclass
class DecodePath:
    """Which path decode steps take — ``captured``, ``compiled`` or ``eager`` — and why."""

    name: str
    reason: str = ""

    def describe(self) -> str:
        return f"{self.name} ({self.reason})" if self.reason else self.name


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, at most 300 characters (a reason in the decode path)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def check_fast_step(fast, eager, rtol: float = 0.0, names: tuple[str, str] = ("fast step", "eager one")) -> str | None:
    """Run ``fast()`` then ``eager()`` (each returns the step's logits from the same inputs); None
    when every row has the same argmax and ``max |Δ| <= rtol * max(1, max |logit|)``, else why not
    (the exception, or how far apart they are), the two named by ``names``."""
    name, other = names
    try:
        got = fast()
    except Exception as exc:  # noqa: BLE001 - any failure of the fast path means eager
        return f"the {name} failed: {one_line(exc)}"
    want = eager()
    if got.shape != want.shape:
        return f"the {name}'s logits have shape {tuple(got.shape)}, the {other}'s {tuple(want.shape)}"
    got, want = got.float(), want.float()
    diff = float((got - want).abs().max())
    same = bool(torch.equal(got.argmax(-1), want.argmax(-1)))
    if not same or diff > rtol * max(1.0, float(want.abs().max())):
        return f"the {name} differs from the {other} (max |Δ logit| {diff:.3g}, argmax {'same' if same else 'different'})"
    return None


def guards_on_the_inputs(entries) -> list[bool]:
    """The dynamo guards a compiled step keeps: those on its inputs (a bucket's tensors and step
    metadata) and on global state; not the ~3,400 on the model's modules and on module globals,
    which never change once the model is loaded (checking them took 1.2 ms a step on the default
    model)."""
    return [not entry.name.startswith(("self", "G[")) for entry in entries]


def paired_medians_s(first, second, runs: int = 7) -> tuple[float, float]:
    """The median times of ``runs`` calls of ``first`` and of ``second``, in seconds, the calls
    taking turns: a burst of load from another process slows both alike, where timing one
    function's runs and then the other's charged it to one of them (a compiled batch-4 step was
    dropped in one start of three on this machine, 0.69 of the eager step's time in the others)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        for fn, spent in zip((first, second), times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return sorted(times[0])[runs // 2], sorted(times[1])[runs // 2]
