"""``python -m gyrfalcon.bench.speculation``: does speculation change any answer, and what does it buy?

The same requests go through two engines built as the server builds them, one without
``--speculative-config`` (the baseline of the same run) and one with it: ``--prompts`` prompts,
half random token ids and half edit prompts (:mod:`gyrfalcon.bench.workloads`), greedy and seeded
sampled in turn, with logprobs, ``--concurrency`` at a time. It prints how many answers are
identical — tokens and logprobs — between the two, each engine's output tokens per second, and
the share of draft tokens accepted.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}'


def requests_of(prompts: list[list[int]], max_tokens: int) -> list[Any]:
    """Greedy and seeded sampled requests in turn, each with its sampled tokens' logprobs and the top 2."""
    from gyrfalcon.engine_api.types import EngineRequest, SamplingParams

    return [EngineRequest(f"p{i}", prompt, SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i, logprobs=2,
                                                         max_tokens=max_tokens, ignore_eos=True))
            for i, prompt in enumerate(prompts)]  # fmt: skip


def serve_all(engine: Any, requests: list[Any], concurrency: int) -> tuple[list[tuple], float]:
    """Every request's tokens and logprobs, ``concurrency`` in flight, and the output tokens per second."""
    answers: list[tuple] = [()] * len(requests)
    started, tokens = time.perf_counter(), 0
    for first in range(0, len(requests), concurrency):
        batch = requests[first : first + concurrency]
        streams = [engine.submit(request) for request in batch]
        for offset, stream in enumerate(streams):
            choice = list(stream)[-1].outputs[0]
            answers[first + offset] = (choice.token_ids, choice.logprobs.logprobs, choice.logprobs.top_logprobs)
            tokens += len(choice.token_ids)
    return answers, tokens / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gyrfalcon.bench.speculation", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder or .gguf (default: the embedded default model)")
    p.add_argument("--speculative-config", default=DEFAULT_SPEC)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from gyrfalcon.bench.client import prompts as random_prompts
    from gyrfalcon.bench.workloads import edit_prompts
    from gyrfalcon.config import Settings
    from gyrfalcon.kernels.native.cpu import cpu
    from gyrfalcon.models.default import resolve_model
    from gyrfalcon.bench.local import ready_engine

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    half = args.prompts // 2
    prompts = random_prompts(half, 24, len(tokenizer), seed=1)
    prompts += [tokenizer(text)["input_ids"] for text in edit_prompts(args.prompts - half, path, seed=1, words=40)]
    requests = requests_of(prompts, args.max_tokens)
    results = {}
    for name, spec in (("off", None), ("on", args.speculative_config)):
        built = ready_engine(Settings(model=path, num_threads=args.num_threads, speculative_config=spec), path)
        if built is None:
            return 1
        engine = built[0]
        answers, rate = serve_all(engine, requests, args.concurrency)
        results[name] = (answers, rate, engine.core.stats(), engine.health().speculative)
        engine.shutdown(grace=1.0)
    (off, off_rate, _, _), (on, on_rate, stats, described) = results["off"], results["on"]
    same = sum(a == b for a, b in zip(off, on))
    same_tokens = sum(a[0] == b[0] for a, b in zip(off, on))
    drafted, accepted = stats.get("spec_decode_num_draft_tokens", 0), stats.get("spec_decode_num_accepted_tokens", 0)
    print(f"{cpu().describe()}, {args.num_threads} thread(s); {args.prompts} prompts (half random ids, half edit), "
          f"greedy and seeded sampled in turn, {args.max_tokens} tokens, {args.concurrency} at a time; "
          f"speculative: {described}")  # fmt: skip
    print(f"identical answers (tokens and logprobs): {same} of {len(off)}; identical tokens: {same_tokens}")
    print(f"output tok/s: off {off_rate:.1f}, on {on_rate:.1f} ({on_rate / off_rate:.2f}x); "
          f"draft tokens accepted: {accepted} of {drafted} ({accepted / max(drafted, 1):.0%})")  # fmt: skip
    return 0 if same == len(off) else 1


if __name__ == "__main__":
    sys.exit(main())
