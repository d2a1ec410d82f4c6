"""What a constraint costs: ``python -m gyrfalcon.bench.structured [--model DIR] [--batch 16]``.

Prints, measured in the same run on the same engine: the time per decode step of a batch whose
every row is constrained (a regex no row can finish within ``--tokens``) against the same batch
unconstrained (median of alternating runs), and the time to make a matcher for a JSON schema the
first time (compilation) and the second (a cache hit).

Targets (issue "Structured outputs and tool calling"): the mask adds at most 10 % to a decode step at
batch 16 on the CPU; a cache hit takes at most 1 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from gyrfalcon.config import Settings
from gyrfalcon.engine_api.types import EngineRequest, OutputKind, SamplingParams

#: a constraint that lets every row run to the end (ignore_eos keeps them all going)
ENDLESS = {"regex": "[a-z ]+"}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
          "age": {"type": "integer", "minimum": 0}}, "required": ["name", "age"], "additionalProperties": False}  # fmt: skip


def _step_ms(engine, validator, batch: int, tokens: int, constraint) -> float:
    """Milliseconds per decode step of ``batch`` rows generating ``tokens`` each (after the prefill)."""
    prompt = engine.tokenize("Write a few words about the sea:")
    params = SamplingParams(n=batch, max_tokens=tokens, temperature=1.0, seed=1, ignore_eos=True,
                            structured_outputs=constraint)  # fmt: skip
    request = EngineRequest(f"bench-{time.monotonic_ns()}", prompt, params, OutputKind.DELTA)
    validator.check(request)  # what the API side runs before every submit
    stream = engine.submit(request)
    first = None
    for output in stream:
        if first is None:
            first = time.perf_counter()
    assert first is not None
    return (time.perf_counter() - first) * 1000 / (tokens - 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gyrfalcon.bench.structured", description=__doc__)
    p.add_argument("--model", default=None, help="model folder or .gguf (default: embedded)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=Settings.num_threads)
    args = p.parse_args(argv)

    from gyrfalcon.plugins import plugin_manager
    from gyrfalcon.plugins.engines import create_transformers_engine
    from gyrfalcon.structured.processor import StructuredOutputProcessor
    from gyrfalcon.validation import RequestValidator

    settings = Settings(model=args.model, max_num_seqs=args.batch, num_threads=args.num_threads, device="cpu", dtype="float32")
    engine = create_transformers_engine(settings)
    assert engine.wait_ready(600).ready, engine.health().message
    validator = RequestValidator.of(plugin_manager(), engine.info())
    try:
        _step_ms(engine, validator, args.batch, 4, None)  # warm-up
        plain, masked = [], []
        for _ in range(args.rounds):
            plain.append(_step_ms(engine, validator, args.batch, args.tokens, None))
            masked.append(_step_ms(engine, validator, args.batch, args.tokens, ENDLESS))
        processor = StructuredOutputProcessor(engine.info())
        processor.compiled({"json": {"type": "object"}})  # the tokenizer view, built once per engine
        started = time.perf_counter()
        processor.compiled({"json": SCHEMA})
        cold = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        processor.compiled({"json": json.loads(json.dumps(SCHEMA))})
        warm = (time.perf_counter() - started) * 1000
    finally:
        engine.shutdown(0)
    ratio = statistics.median(masked) / statistics.median(plain)
    print(f"decode step at batch {args.batch}: unconstrained {statistics.median(plain):.1f} ms "
          f"({', '.join(f'{v:.1f}' for v in plain)}), every row constrained {statistics.median(masked):.1f} ms "
          f"({', '.join(f'{v:.1f}' for v in masked)}): ratio {ratio:.3f} (target <= 1.10)")  # fmt: skip
    print(f"JSON schema matcher: first {cold:.2f} ms (compiled), second {warm:.3f} ms (cache hit; target <= 1 ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
