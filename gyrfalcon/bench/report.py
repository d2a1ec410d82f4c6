"""The report of a ``gyrfalcon bench`` run: the markdown table, the target ratios and the JSON figures.

The targets depend on the device: on a CPU the engine is measured against the eager loop (the
bare loop is the best torch does there); on a GPU against the compiled static-cache loop, since an
eager step is bound by kernel launches and CUDA graphs are what remove them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gyrfalcon.bench.ceiling import CeilingResult
from gyrfalcon.bench.client import LoadReport


@dataclass
class Target:
    """One target ratio: ``value`` must be ``op`` (``≥`` or ``≤``) ``target``."""

    label: str
    value: float
    op: str
    target: float

    @property
    def met(self) -> bool:
        if self.value != self.value:  # NaN: nothing was measured
            return False
        return self.value >= self.target if self.op == "≥" else self.value <= self.target

    def line(self) -> str:
        return f"- {self.label}: {_fmt(self.value, 2)} (target {self.op} {self.target:g}: {'met' if self.met else 'missed'})"


def _fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None or x != x else f"{x:.{digits}f}"


#: CPU targets against the fp32 eager loop (no quantisation) and against the peer server — llama.cpp's
#: own llama-server on the same GGUF, 16 slots (docs/kernels.md) — by concurrency
BASELINE_TARGETS = {1: 4.0, 16: 2.0}
PEER_TARGETS = {1: 1.0, 16: 1.5}


def targets(device: str, loads: list[LoadReport], eager: dict[int, CeilingResult], compiled: dict[int, CeilingResult],
            n_cmp: dict[str, float] | None, baseline: dict[int, CeilingResult] | None = None,
            peer: list[LoadReport] | None = None) -> list[Target]:  # fmt: skip
    """The target ratios of ``device`` (``cpu`` or ``cuda…``) that this run measured both figures of."""
    by_c = {load.concurrency: load for load in loads}
    out = []
    for c, target in BASELINE_TARGETS.items():
        if not device.startswith("cuda") and c in by_c and c in (baseline or {}):
            out.append(Target(f"c={c} output tok/s / fp32 eager loop at batch {c}",
                              by_c[c].output_tokens_per_s / baseline[c].output_tokens_per_s, "≥", target))  # fmt: skip
    peers = {load.concurrency: load for load in peer or []}
    for c, target in PEER_TARGETS.items():
        if not device.startswith("cuda") and c in by_c and c in peers and peers[c].output_tokens_per_s > 0:
            out.append(Target(f"c={c} output tok/s / the peer's", by_c[c].output_tokens_per_s / peers[c].output_tokens_per_s,
                              "≥", target))  # fmt: skip
    if device.startswith("cuda"):
        if 64 in by_c and 64 in compiled:
            out.append(Target("c=64 output tok/s / compiled ceiling at batch 64",
                              by_c[64].output_tokens_per_s / compiled[64].output_tokens_per_s, "≥", 0.8))  # fmt: skip
        if 1 in by_c and 1 in compiled:
            out.append(Target("c=1 TPOT p50 / compiled step at batch 1", by_c[1].tpot(50) / compiled[1].time_per_step, "≤", 1.3))
        if 1 in by_c and 64 in by_c:
            out.append(Target("c=64 TPOT p50 / c=1 TPOT p50", by_c[64].tpot(50) / by_c[1].tpot(50), "≤", 1.5))
        n_target = 0.2
    else:
        if 16 in by_c and 16 in eager:
            out.append(Target("c=16 output tok/s / eager ceiling at batch 16",
                              by_c[16].output_tokens_per_s / eager[16].output_tokens_per_s, "≥", 0.95))  # fmt: skip
        if 1 in by_c and 1 in eager:
            out.append(Target("c=1 TPOT p50 / eager step at batch 1", by_c[1].tpot(50) / eager[1].time_per_step, "≤", 1.05))
        n_target = 0.25
    if n_cmp and n_cmp["n"] == 8:  # the target is for n = 8; other n print their ratio without one
        label = f"n=8 request {n_cmp['n_request_s']:.2f} s / 8 sequential n=1 requests {n_cmp['sequential_s']:.2f} s"
        out.append(Target(label, n_cmp["ratio"], "≤", n_target))
    return out


def table(loads: list[LoadReport], eager: dict[int, CeilingResult], compiled: dict[int, CeilingResult] | None = None,
          n_cmp: dict[str, float] | None = None, memory: dict[str, Any] | None = None, device: str = "cpu",
          compiled_error: str | None = None, peak_memory: int | None = None,
          baseline: dict[int, CeilingResult] | None = None, peer: list[LoadReport] | None = None,
          variant: str | None = None) -> str:  # fmt: skip
    """The markdown table of a run, then one line per target ratio and the other findings.

    ``ceiling`` columns are the eager loop; ``compiled`` columns (only when measured) the static-cache
    loop; ``fp32 loop`` the CPU baseline (unquantised fp32 eager loop); ``peer`` the same load on
    another server: llama-server, whose targets are checked, or the same server with the options
    ``variant`` (``--peer-serve-args``), whose speed-up is printed instead.
    """
    compiled = compiled or {}
    baseline = baseline or {}
    peers = {load.concurrency: load for load in peer or []}
    head = ["concurrency", "req/s", "output tok/s", "ceiling tok/s", "ratio", "TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)",
            "ceiling step (ms)", "errors"]  # fmt: skip
    if compiled:
        head += ["compiled tok/s", "compiled step (ms)"]
    if baseline:
        head += ["fp32 loop tok/s", "ratio"]
    if peers:
        head += ["peer tok/s", "peer TPOT p50 (ms)", "ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    nan = float("nan")
    for load in loads:
        ceiling = eager.get(load.concurrency)
        ceil_tps = ceiling.output_tokens_per_s if ceiling else nan
        ceil_step = ceiling.time_per_step * 1000 if ceiling else nan
        cells = [
            str(load.concurrency), _fmt(load.request_throughput, 2), _fmt(load.output_tokens_per_s), _fmt(ceil_tps),
            _fmt(load.output_tokens_per_s / ceil_tps, 2),
            f"{_fmt(load.ttft(50) * 1000, 0)} / {_fmt(load.ttft(99) * 1000, 0)}",
            f"{_fmt(load.tpot(50) * 1000)} / {_fmt(load.tpot(99) * 1000)}", _fmt(ceil_step), str(load.errors),
        ]  # fmt: skip
        if compiled:
            fast = compiled.get(load.concurrency)
            cells += [_fmt(fast.output_tokens_per_s if fast else nan), _fmt(fast.time_per_step * 1000 if fast else nan, 2)]
        if baseline:
            base = baseline[load.concurrency].output_tokens_per_s if load.concurrency in baseline else nan
            cells += [_fmt(base), _fmt(load.output_tokens_per_s / base, 2)]
        if peers:
            other = peers.get(load.concurrency)
            tps = other.output_tokens_per_s if other else nan
            cells += [_fmt(tps), _fmt(other.tpot(50) * 1000 if other else nan), _fmt(load.output_tokens_per_s / tps if tps else nan, 2)]
        lines.append("| " + " | ".join(cells) + " |")
    out = ["\n".join(lines), ""]
    out.extend(t.line() for t in targets(device, loads, eager, compiled, n_cmp, baseline, peer if variant is None else None))
    out.extend(f"- c={c}: output tok/s with {variant or 'no more options'} / without: {x:.2f}"
               for c, x in variant_ratios(loads, peer, variant))  # fmt: skip
    out.extend(_findings(n_cmp, memory, compiled, compiled_error, peak_memory))
    return "\n".join(out)


def variant_ratios(loads: list[LoadReport], peer: list[LoadReport] | None, variant: str | None) -> list[tuple[int, float]]:
    """Per level, the peer's output tok/s over the server's where the peer is the same server with
    the options ``variant``; none otherwise."""
    peers = {load.concurrency: load for load in peer or []}
    return [(load.concurrency, peers[load.concurrency].output_tokens_per_s / load.output_tokens_per_s)
            for load in loads if variant is not None and load.concurrency in peers and load.output_tokens_per_s > 0]


def _findings(n_cmp: dict[str, float] | None, memory: dict[str, Any] | None, compiled: dict[int, CeilingResult],
              compiled_error: str | None, peak_memory: int | None) -> list[str]:
    """The table's lines after the targets: the n comparison (when it is not a target's), memory,
    the compiled ceiling's compile times or failure, the ceilings' peak memory."""
    out = []
    if n_cmp and n_cmp["n"] != 8:
        out.append(f"- n={n_cmp['n']} request {n_cmp['n_request_s']:.2f} s / {n_cmp['n']} sequential n=1 requests "
                   f"{n_cmp['sequential_s']:.2f} s: {n_cmp['ratio']:.2f}")  # fmt: skip
    if memory and memory.get("rss_before"):
        out.append(f"- worker RSS before / after {memory['requests']} mixed requests: {memory['rss_before'] / 2**20:.0f} MiB / "
                   f"{memory['rss_after'] / 2**20:.0f} MiB, growth {memory['growth'] * 100:.1f} % (target < 5 %), "
                   f"{memory['errors']} errors")  # fmt: skip
    if compiled:
        parts = ", ".join(f"{r.compile_s:.1f} s at batch {c}" for c, r in sorted(compiled.items()) if r.compile_s is not None)
        if parts:
            out.append(f"- compiled ceiling, compile + capture (first call, which also runs once): {parts}")
    if compiled_error:
        out.append(f"- compiled ceiling failed: {compiled_error}")
    if peak_memory is not None:
        out.append(f"- peak device memory of the ceilings: {peak_memory / 2**30:.2f} GiB")
    return out


def _ceilings(results: dict[int, CeilingResult]) -> dict[int, dict[str, Any]]:
    return {c: {"tok_per_s": r.output_tokens_per_s, "step_s": r.time_per_step, "prefill_s": r.prefill_s,
                "total_s": r.total_s, "compile_s": r.compile_s} for c, r in results.items()}  # fmt: skip


def _loads(loads: list[LoadReport]) -> list[dict[str, Any]]:
    return [{"concurrency": x.concurrency, "requests": len(x.results), "req_per_s": x.request_throughput,
             "tok_per_s": x.output_tokens_per_s, "ttft_p50": x.ttft(50), "ttft_p99": x.ttft(99),
             "tpot_p50": x.tpot(50), "tpot_p99": x.tpot(99), "errors": x.errors} for x in loads]  # fmt: skip


def figures(device: str, loads: list[LoadReport], eager: dict[int, CeilingResult], compiled: dict[int, CeilingResult],
            n_cmp: dict[str, float] | None, memory: dict[str, Any] | None, baseline: dict[int, CeilingResult] | None = None,
            peer_loads: list[LoadReport] | None = None, variant: str | None = None, **extra: Any) -> dict[str, Any]:  # fmt: skip
    """Everything of the report as JSON-ready data (``extra``: run facts such as wall time and build
    time; ``variant``: :func:`table`'s)."""
    return {
        "device": device,
        "loads": _loads(loads),
        "peer_loads": _loads(peer_loads or []),
        "baseline_ceilings": _ceilings(baseline or {}),
        "ceilings": _ceilings(eager),
        "compiled_ceilings": _ceilings(compiled),
        "n": n_cmp,
        "memory": memory,
        "targets": [{"label": t.label, "value": t.value, "op": t.op, "target": t.target, "met": t.met}
                    for t in targets(device, loads, eager, compiled, n_cmp, baseline, peer_loads if variant is None else None)],  # fmt: skip
        "variant": variant,
        "variant_ratios": dict(variant_ratios(loads, peer_loads, variant)),
        **extra,
    }
