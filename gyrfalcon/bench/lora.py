"""``python -m gyrfalcon.bench.lora``: what serving LoRA adapters costs.

Two engines built as the server builds them serve the same ``--requests`` random prompts,
``--concurrency`` at a time: the base model alone (the baseline of the same run) and the same model
with ``--enable-lora`` and ``--adapters`` random adapters of rank ``--rank`` on every projection,
the requests spread over the adapters in turn. The second engine also serves the requests with no
adapter (what ``--enable-lora`` costs the base model's own requests). Each adapter's load
(``load_lora_adapter``) is timed beside a read of its files (page cache warm, as after a trainer
wrote them). Prints output tokens per second and the ratios; the targets are ≥ 0.8x the base model
at c=16 with 4 adapters, and a load ≤ 2x the read.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def write_random_adapter(shapes: dict[tuple[int, str], tuple[int, int]], out: Path, rank: int, seed: int) -> Path:
    """A PEFT folder of random factors (both non-zero, as training leaves them) for every projection of ``shapes``."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for (layer, module), (rows, columns) in shapes.items():
        parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, columns, generator=generator) * 0.01
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(rows, rank, generator=generator) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    modules = sorted({module for _, module in shapes})
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": modules, "bias": "none"}))  # fmt: skip
    return out


def rate(engine: Any, requests: list[Any], concurrency: int) -> float:
    """Output tokens per second of ``requests``, ``concurrency`` in flight."""
    started, tokens = time.perf_counter(), 0
    for first in range(0, len(requests), concurrency):
        streams = [engine.submit(request) for request in requests[first : first + concurrency]]
        tokens += sum(len(list(stream)[-1].outputs[0].token_ids) for stream in streams)
    return tokens / (time.perf_counter() - started)


def load_timed(engine: Any, names: list[str], rank: int) -> None:
    """Load a random adapter of ``rank`` under each name, each load's table row beside a read of its files."""
    from gyrfalcon.bench.control import read_seconds

    print("| adapter | read its files | load_lora_adapter | ratio |\n|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for i, name in enumerate(names):
            adapter = write_random_adapter(engine.core.lora.shapes, Path(folder) / name, rank, seed=i)
            read_seconds(str(adapter))  # the page cache warm, as after a trainer wrote the files
            read, size = read_seconds(str(adapter))
            started = time.perf_counter()
            engine.load_lora_adapter(name, str(adapter))
            took = time.perf_counter() - started
            print(f"| {name} | {read:.4f} s ({size / 2**20:.1f} MiB) | {took:.4f} s | {took / read:.1f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gyrfalcon.bench.lora", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder or .gguf (default: the embedded default model)")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args(argv)

    from gyrfalcon.bench.client import prompts as random_prompts
    from gyrfalcon.bench.local import ready_engine
    from gyrfalcon.config import Settings
    from gyrfalcon.engine_api.types import EngineRequest, SamplingParams
    from gyrfalcon.kernels.native.cpu import cpu
    from gyrfalcon.models.default import resolve_model

    path = resolve_model(args.model)
    base = ready_engine(Settings(model=path, num_threads=args.num_threads), path)
    if base is None:
        return 1
    engine = base[0]
    vocab = engine.info().vocab_size
    prompts = random_prompts(args.requests, 24, vocab, seed=1)

    def requests(adapters: list[str | None]) -> list[Any]:
        return [EngineRequest(f"r{i}-{time.monotonic_ns()}", prompt, SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                                                     ignore_eos=True),
                              lora_name=adapters[i % len(adapters)]) for i, prompt in enumerate(prompts)]  # fmt: skip

    rate(engine, requests([None])[: args.concurrency], args.concurrency)  # warm
    base_rate = rate(engine, requests([None]), args.concurrency)
    described = engine.health().decode_path
    engine.shutdown(grace=1.0)
    settings = Settings(model=path, num_threads=args.num_threads, enable_lora=True, max_loras=args.adapters,
                        max_lora_rank=args.rank)  # fmt: skip
    built = ready_engine(settings, path)
    if built is None:
        return 1
    engine = built[0]
    names = [f"adapter-{i}" for i in range(args.adapters)]
    print(f"{cpu().describe()}, {args.num_threads} thread(s); {Path(path).name}; {args.requests} requests of "
          f"{args.max_tokens} tokens, {args.concurrency} at a time; {args.adapters} adapters of rank {args.rank}\n")
    load_timed(engine, names, args.rank)
    rate(engine, requests(names)[: args.concurrency], args.concurrency)  # warm
    adapted = rate(engine, requests(names), args.concurrency)
    unadapted = rate(engine, requests([None]), args.concurrency)
    print(f"\n| served | decode path | output tok/s | ratio to the base model |\n|---|---|---|---|")
    print(f"| base model (baseline) | {described} | {base_rate:.1f} | 1.00 |")
    print(f"| --enable-lora, requests over {args.adapters} adapters | {engine.health().decode_path} | {adapted:.1f} | "
          f"{adapted / base_rate:.2f} |")  # fmt: skip
    print(f"| --enable-lora, requests of the base model | {engine.health().decode_path} | {unadapted:.1f} | "
          f"{unadapted / base_rate:.2f} |")  # fmt: skip
    engine.shutdown(grace=1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
