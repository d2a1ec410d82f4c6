"""``python -m gyrfalcon.bench.control``: what the RL control plane costs: a swap of the weights, and a sleep.

An engine is built as the server builds it (the defaults, or ``--model``, ``--kv-cache-memory``)
and warmed by one request.

- **The swap**: ``update_weights`` with the served folder itself, ``--swaps`` times, beside the
  seconds it takes to read every file of that folder (the page cache warm, as after the trainer
  wrote them; the baseline of the same run; the target is ≤ 2×), and the process's resident memory
  before and after the swaps.
- **The sleep**, for each level: the resident memory awake, asleep and woken again
  (``/proc/self/statm``), beside the KV cache's size and the weights' (the target: level 1 hands
  back at least the KV cache); the seconds ``wake_up`` takes, and the seconds from the wake's call
  to the end of one short greedy request, beside the same request's seconds awake before the sleep
  (another prompt each time, so no cached prefix helps either).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

#: the request timed before each sleep and after each wake: a short greedy answer
MAX_TOKENS = 16


def resident() -> int:
    """This process's resident bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def answer_time(engine: Any, validator: Any, prompt: list[int], name: str) -> float:
    """Seconds for one greedy request of :data:`MAX_TOKENS` tokens over ``prompt``, submitted to its last output."""
    from gyrfalcon.engine_api.types import EngineRequest, SamplingParams

    request = EngineRequest(name, prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    validator.check(request)
    started = time.perf_counter()
    outputs = list(engine.submit(request))
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == MAX_TOKENS
    return time.perf_counter() - started


def read_seconds(path: str) -> tuple[float, int]:
    """Seconds to read every file of the model's folder (or the one file), and their bytes."""
    files = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names] if os.path.isdir(path) else [path]
    started, size = time.perf_counter(), 0
    for name in files:
        with open(name, "rb") as f:
            while chunk := f.read(1 << 24):
                size += len(chunk)
    return time.perf_counter() - started, size


def swap(core: Any, path: str, swaps: int) -> None:
    """The swap's table: each ``update_weights`` of ``path`` against a read of its files."""
    read_seconds(path)  # the page cache warm, as after the trainer wrote the files
    before = resident()
    print("| swap | read the files | update_weights | ratio |")
    print("|---|---|---|---|")
    for i in range(swaps):
        read, size = read_seconds(path)
        started = time.perf_counter()
        core.update_weights(path, f"swap-{i}")
        took = time.perf_counter() - started
        print(f"| {i + 1} | {read:.3f} s ({size / 2**20:.0f} MiB) | {took:.3f} s | {took / read:.1f} |", flush=True)
    print(f"\nresident before the swaps {before / 2**20:.0f} MiB, after {resident() / 2**20:.0f} MiB\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gyrfalcon.bench.control", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder or .gguf (default: the embedded default model)")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache (default: the server's)")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--swaps", type=int, default=5)
    args = p.parse_args(argv)

    from gyrfalcon.config import Settings
    from gyrfalcon.engine.weights import served_tensors
    from gyrfalcon.kernels.native.cpu import cpu
    from gyrfalcon.models.default import resolve_model
    from gyrfalcon.bench.local import ready_engine
    from gyrfalcon.validation import RequestValidator

    path = resolve_model(args.model)
    settings = Settings(model=path, num_threads=args.num_threads, kv_cache_memory=args.kv_cache_memory)
    if (built := ready_engine(settings, path)) is None:
        return 1
    engine, pm = built
    validator = RequestValidator.of(pm, engine.info())
    core = engine.core
    direct = core.runner.direct
    weights = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in
                   served_tensors(core.runner.model, direct.layers if direct is not None else []).values()}.values())  # fmt: skip
    cache = core.cache_plan.bytes
    prompts = iter([[10 + 7 * i + j for j in range(24)] for i in range(16)])
    answer_time(engine, validator, next(prompts), "warm-up")
    print(f"{cpu().describe()}, {args.num_threads} thread(s); {os.path.basename(path)}; decode path: "
          f"{engine.health().decode_path}; KV cache {cache / 2**20:.0f} MiB, weights {weights / 2**20:.0f} MiB\n")
    swap(core, path, args.swaps)
    print("| level | resident awake | asleep | handed back | handed back / its target | woken | wake_up | "
          "wake_up + answer | answer awake (baseline) | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for level in (1, 2):
        baseline = answer_time(engine, validator, next(prompts), f"before-{level}")
        awake = resident()
        engine.sleep(level)
        while not engine.sleep_state().settled:
            time.sleep(0.01)
        asleep = resident()
        started = time.perf_counter()
        engine.wake_up()
        woke = time.perf_counter() - started
        served = woke + answer_time(engine, validator, next(prompts), f"after-{level}")
        target = cache + (weights if level == 2 else 0)
        print(f"| {level} | {awake / 2**20:.0f} MiB | {asleep / 2**20:.0f} MiB | {(awake - asleep) / 2**20:.0f} MiB | "
              f"{(awake - asleep) / target:.2f} | {resident() / 2**20:.0f} MiB | {woke:.3f} s | {served:.3f} s | "
              f"{baseline:.3f} s | {served / baseline:.2f} |", flush=True)  # fmt: skip
    engine.shutdown(grace=1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
