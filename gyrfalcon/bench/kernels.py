"""``python -m gyrfalcon.bench.kernels``: the int4 layers' kernels side by side, one per input format.

What ``--matmul-inputs auto`` chooses from (:data:`gyrfalcon.kernels.quant.q4.INPUTS`): the products
of one decode step of a model's shapes (the default model's: q/k/v and gate/up fused, 30 layers, 120
products, 66 MB of 4-bit weights), each layer's weights its own random ``Q4_1`` blocks so that they
stream from memory as a served model's do, at a few row counts (one decode row, a batch, a prefill
chunk), on this machine's threads. Each format's time is printed beside the fp32 format's measured
in the same run, and the header names the CPU and the instruction set the kernels were built for
(cap it with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` to
measure the AVX2 build on an AVX-512 machine: docs/kernels.md).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

#: (out, in) features of one decoder layer's four products, the default model's (SmolLM2-135M)
DEFAULT_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def layer_shapes(config: str | None) -> tuple[tuple[int, int], ...]:
    """One layer's products' shapes from a Llama-shaped ``config.json`` (q/k/v and gate/up fused),
    else the default model's."""
    if config is None:
        return DEFAULT_SHAPES
    c = json.loads(Path(config).read_text())
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    dim = c.get("head_dim") or hidden // heads
    kv = c.get("num_key_value_heads", heads) * dim
    return ((heads * dim + 2 * kv, hidden), (hidden, heads * dim), (2 * c["intermediate_size"], hidden),
            (hidden, c["intermediate_size"]))  # fmt: skip


def measure(shapes, layers: int, rows: int, formats, threads: int, repeats: int = 7) -> dict:
    """Seconds per pass over ``layers`` layers of ``shapes`` at ``rows`` rows, best of ``repeats``, per format."""
    import torch

    from gyrfalcon.kernels.native import loaded
    from gyrfalcon.kernels.quant.q4 import KERNELS, pack
    from gyrfalcon.kernels.quant.weights import Int4Weights

    generator = torch.Generator().manual_seed(0)
    weights = [Int4Weights(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator),
                           (torch.rand(n, k // 32, generator=generator) * 0.01 + 0.001).half().float(),
                           (torch.rand(n, k // 32, generator=generator) * -0.05).half().float())
               for _ in range(layers) for n, k in shapes]  # fmt: skip
    inputs = {k: torch.randn(rows, k, generator=generator) for _, k in shapes}
    outputs = {n: torch.empty(rows, n) for n, _ in shapes}
    times = {}
    for fmt in formats:
        kernel = getattr(loaded(), KERNELS[fmt])
        packed = [(w.shape, *pack(w, fmt)) for w in weights]
        calls = [(inputs[k].data_ptr(), nibbles.data_ptr(), scales.data_ptr(), outputs[n].data_ptr(), rows, n, k,
                  threads) for (n, k), nibbles, scales in packed]  # fmt: skip

        def one_pass():
            for call in calls:
                if kernel(*call):
                    raise MemoryError(f"{KERNELS[fmt]} failed")

        one_pass()
        passes = max(1, 16 // rows)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(passes):
                one_pass()
            best = min(best, (time.perf_counter() - start) / passes)
        times[fmt] = best
        del packed, calls
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gyrfalcon.bench.kernels", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="a Llama-shaped config.json whose shapes to use (default: the "
                   "default model's)")  # fmt: skip
    p.add_argument("--layers", type=int, default=30, help="decoder layers a pass (default 30, the default model's)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 512], help="rows a product (default 1 4 16 512)")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = p.parse_args(argv)

    import torch

    from gyrfalcon.kernels.native import library
    from gyrfalcon.kernels.native.cpu import cpu
    from gyrfalcon.kernels.quant.q4 import KERNELS, q4_inputs

    torch.set_num_threads(args.threads)
    library(None)
    shapes = layer_shapes(args.config)
    formats = [torch.float32, *(f for f in KERNELS if f != torch.float32)]
    bytes_a_pass = args.layers * sum(n * k // 32 * 20 for n, k in shapes)  # a Q4_1 block: 16 bytes and 2 fp16
    default = str(q4_inputs()).removeprefix("torch.")
    print(f"{cpu().describe()}; {args.threads} threads; {args.layers} layers of {list(shapes)}, "
          f"{bytes_a_pass / 1e6:.0f} MB of weights a pass; --matmul-inputs auto here: {default}\n")
    names = [str(f).removeprefix("torch.") for f in formats]
    speedups = " | ".join(f"{n}: speed-up over float32" for n in names[1:])
    print("| rows | " + " | ".join(f"{n} ms" for n in names) + f" | {speedups} |")
    print("|---" * (2 * len(names)) + "|")
    for rows in args.rows:
        layers = args.layers if rows <= 64 else 1  # a prefill chunk: one layer of each shape
        t = measure(shapes, layers, rows, formats, args.threads)
        ms = " | ".join(f"{t[f] * 1e3:.2f}" for f in formats)
        ratios = " | ".join(f"{t[torch.float32] / t[f]:.2f}x" for f in formats[1:])
        print(f"| {rows}{'' if layers == args.layers else ' (one layer)'} | {ms} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
