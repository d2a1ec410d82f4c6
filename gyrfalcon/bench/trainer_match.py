"""``python -m gyrfalcon.bench.trainer_match``: do the rollouts' logprobs equal the trainer's?

An RL trainer computes, with a plain ``transformers`` forward over prompt + rollout, the logprob of
every token the server sampled; on-policy training wants the server's own logprob of each sampled
token (``--logprobs-mode raw_logprobs``, the default) to be that value. This serves seeded sampled
rollouts through the engine in several batch mixes — one request alone, 8 and 64 prompts of
different lengths at once, 4 prompts with ``n`` = 8 beside 8 other requests — and compares every
sampled token's logprob with one forward per rollout of the trainer's model: the same folder loaded
by ``transformers`` in fp32 without quantisation (a GGUF's weights dequantised). It prints, per mix,
the rollouts, the tokens and the largest and mean ``|Δ|``, and as the baseline of the same run the
trainer's model against itself: decoding the batch-8 rollouts a token at a time with its KV cache,
as a server does, against its one forward over each (what fp32 leaves between the two shapes). The engine is built as the server builds
it (``--quantization`` and ``--dtype`` as given); its requests pass the server's validator.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

#: the batch mixes: (name, prompts, n, other requests beside them)
MIXES = (("batch 1", 1, 1, 0), ("batch 8", 8, 1, 0), ("batch 64", 64, 1, 0), ("n = 8 beside 8 others", 4, 8, 8))


@dataclass
class Rollout:
    """One choice the server sampled: its prompt, its tokens and their logprobs as served."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]


def prompts_of(count: int, vocab: int, seed: int, shortest: int = 3, longest: int = 40) -> list[list[int]]:
    """``count`` prompts of different lengths (from ``shortest`` to ``longest`` tokens), ids drawn
    from the vocabulary's lower half with a seeded generator."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=gen).tolist()
    return [torch.randint(1, vocab // 2, (n,), generator=gen).tolist() for n in lengths]


def serve(engine: Any, validator: Any, prompts: list[list[int]], n: int, others: list[list[int]],
          max_tokens: int, seed: int) -> list[Rollout]:  # fmt: skip
    """The rollouts of ``prompts`` (``n`` choices each, sampled at temperature 1 with a seed) served
    together with ``others`` (greedy, no logprobs), every request submitted before any output is read."""
    from gyrfalcon.engine_api.types import EngineRequest, SamplingParams

    requests = [EngineRequest(f"rollout-{i}", p, SamplingParams(n=n, temperature=1.0, seed=seed + i, logprobs=0,
                                                                max_tokens=max_tokens, ignore_eos=True))
                for i, p in enumerate(prompts)]  # fmt: skip
    requests += [EngineRequest(f"other-{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens // 2 + i))
                 for i, p in enumerate(others)]  # fmt: skip
    for request in requests:
        validator.check(request)
    streams = [engine.submit(request) for request in requests]
    rollouts = []
    for request, stream in zip(requests, streams):
        final = None
        for output in stream:
            final = output
        if not request.request_id.startswith("rollout-"):
            continue
        assert final is not None and final.error is None, final
        for choice in final.outputs:
            rollouts.append(Rollout(request.prompt_token_ids, list(choice.token_ids), list(choice.logprobs.logprobs)))
    return rollouts


def trainer_logprobs(model: Any, rollout: Rollout) -> list[float]:
    """The trainer's logprob of each rollout token: one forward over prompt + rollout, fp32."""
    import torch

    ids = torch.tensor([rollout.prompt + rollout.tokens])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    start = len(rollout.prompt) - 1
    return [float(logprobs[start + j, token]) for j, token in enumerate(rollout.tokens)]


def incremental_logprobs(model: Any, rollout: Rollout) -> list[float]:
    """The same logprobs from the trainer's model decoding as a server does: the prompt at once,
    then a token at a time with its KV cache (the floor fp32 leaves between the two ways)."""
    import torch

    with torch.inference_mode():
        out = model(torch.tensor([rollout.prompt]), use_cache=True)
        values = []
        for token in rollout.tokens:
            values.append(float(torch.log_softmax(out.logits[0, -1].float(), dim=-1)[token]))
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return values


def gaps(model: Any, rollouts: list[Rollout]) -> list[float]:
    """``|served - trainer's|`` for every token of every rollout."""
    return [abs(a - b) for r in rollouts for a, b in zip(r.logprobs, trainer_logprobs(model, r))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gyrfalcon.bench.trainer_match", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder or .gguf (default: the embedded default model)")
    p.add_argument("--quantization", default="none", help="the engine's --quantization (default none: fp32 weights)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    import torch

    from gyrfalcon.config import Settings
    from gyrfalcon.kernels.native.cpu import cpu
    from gyrfalcon.models.default import resolve_model
    from gyrfalcon.models.loading import load_weights
    from gyrfalcon.bench.local import ready_engine
    from gyrfalcon.validation import RequestValidator

    path = resolve_model(args.model)
    settings = Settings(model=path, quantization=args.quantization, dtype=args.dtype, max_num_seqs=64,
                        num_threads=args.num_threads, max_model_len=256)  # fmt: skip
    if (built := ready_engine(settings, path)) is None:
        return 1
    engine, pm = built
    info = engine.info()
    validator = RequestValidator.of(pm, info)
    trainer, _ = load_weights(path, "float32", "cpu", "none")
    torch.set_num_threads(args.num_threads)
    print(f"{cpu().describe()}, {args.num_threads} thread(s); engine: --quantization {args.quantization} --dtype {args.dtype}, {info.quantization} "
          f"layers; trainer: transformers, fp32, no quantisation; decode path: {engine.health().decode_path}\n")  # fmt: skip
    print("| batch mix | rollouts | tokens | max abs Δ logprob | mean abs Δ | served in |")
    print("|---|---|---|---|---|---|")
    for name, count, n, beside in MIXES:
        prompts = prompts_of(count, info.vocab_size, args.seed)
        others = prompts_of(beside, info.vocab_size, args.seed + 1)
        started = time.perf_counter()
        rollouts = serve(engine, validator, prompts, n, others, args.max_tokens, args.seed)
        took = time.perf_counter() - started
        delta = gaps(trainer, rollouts)
        print(f"| {name} | {len(rollouts)} | {len(delta)} | {max(delta):.2e} | {sum(delta) / len(delta):.2e} | "
              f"{took:.1f} s |", flush=True)  # fmt: skip
        if name == "batch 8":  # the baseline: the trainer's model against itself over the same rollouts
            floor = [abs(a - b) for r in rollouts for a, b in zip(incremental_logprobs(trainer, r),
                                                                  trainer_logprobs(trainer, r))]  # fmt: skip
            print(f"| baseline: transformers a token at a time with its KV cache, same 8 rollouts | {len(rollouts)} | "
                  f"{len(floor)} | {max(floor):.2e} | {sum(floor) / len(floor):.2e} | — |", flush=True)  # fmt: skip
    engine.shutdown(grace=1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
