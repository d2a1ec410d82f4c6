"""``python -m gyrfalcon.bench.host_step``: what one decode step costs the host, the model left out.

The engine's step loop (scheduling, block bookkeeping, the runner's inputs and their one copy to the
device, sampling, stop checks, the outputs) around a stub model that returns fixed logits at once: on a GPU this host work is what
must hide behind the device's forward. A tiny random model (its vocabulary is small, so the stub's
logits cost the sampler next to nothing) serves ``--batch`` greedy sequences decoding together; the
median of ``--steps`` steps is printed per batch size, against the targets of the issue "A GPU step
that cannot be wrong" (≤ 0.3 ms at batch 1, ≤ 1 ms at batch 64; measured, not asserted in tests).
"""

from __future__ import annotations

import argparse
import queue
import sys
import tempfile
import time

TARGETS_MS = {1: 0.3, 64: 1.0}


def _stub_model(vocab: int):
    """A ``ModelRunner.run_model`` that runs no model: fixed fp32 logits, one row per kept position.
    The runner's own ``forward`` still builds the step's inputs and sends them to the device."""
    import torch

    fixed = torch.randn(4096, vocab, generator=torch.Generator().manual_seed(0))

    def run_model(input_ids, positions, step, keep):
        return fixed[: keep.shape[0]]

    return run_model


def measure(model_dir: str, batch: int, steps: int, prompt_tokens: int = 4) -> float:
    """The median seconds of a decode step of ``batch`` sequences of ``prompt_tokens``-token prompts
    around the stub."""
    from gyrfalcon.config import Settings
    from gyrfalcon.engine_api.types import EngineRequest, OutputKind, SamplingParams
    from gyrfalcon.plugins import plugin_manager
    from gyrfalcon.plugins.engines import create_transformers_engine
    from gyrfalcon.validation import RequestValidator

    settings = Settings(model=model_dir, max_model_len=steps + prompt_tokens + 60, max_num_seqs=batch, max_queue_len=batch, dtype="float32",
                        device="cpu", seed=0, num_threads=1, enforce_eager=True)  # fmt: skip
    engine = create_transformers_engine(settings, start=False)
    try:
        assert engine.core.prepare()
        core = engine.core
        core.runner.run_model = _stub_model(core.runner.logits_width)
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        prompt = [5 + t % 200 for t in range(prompt_tokens)]
        requests = [EngineRequest(f"host-{batch}-{i}", [i % 5, *prompt[1:]], params, OutputKind.DELTA) for i in range(batch)]
        validator = RequestValidator.of(plugin_manager(), engine.info())
        for request in requests:  # what the API side runs before every submit
            validator.check(request)
        streams = [engine.submit(request) for request in requests]
        while core.batcher.running_sequences < batch or core.batcher.prefilling_requests():
            core.batcher.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            core.batcher.step()
            times.append(time.perf_counter() - start)
            for stream in streams:  # what a consumer takes, so queues stay short
                try:
                    while stream.get(timeout=0) is not None:
                        pass
                except queue.Empty:
                    pass
        return sorted(times)[len(times) // 2]
    finally:
        engine.shutdown(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gyrfalcon.bench.host_step", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=4, help="each sequence's prompt (its context grows from there)")
    args = p.parse_args(argv)
    from gyrfalcon.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="gyrfalcon-host-step-") as folder:
        model_dir = str(build_tiny_model(folder, positions=args.steps + args.prompt_tokens + 60))
        print(f"contexts of {args.prompt_tokens} to {args.prompt_tokens + args.steps} tokens")
        print("| batch | host time per decode step (median) | target |\n|---|---|---|")
        for batch in args.batch:
            ms = measure(model_dir, batch, args.steps, args.prompt_tokens) * 1000
            target = TARGETS_MS.get(batch)
            verdict = f"≤ {target} ms: {'met' if ms <= target else 'missed'}" if target else ""
            print(f"| {batch} | {ms:.3f} ms | {verdict} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
