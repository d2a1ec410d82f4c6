"""A decode step's layers in one call (:mod:`gyrfalcon.engine.model.layer_loop`, ``decode_layers.c``):
the operators' bits, proved before it serves, and refused when it differs."""

from __future__ import annotations

import ctypes

import pytest
import torch

from gyrfalcon.engine.model import layer_loop
from gyrfalcon.kernels import native
from gyrfalcon.kernels.native.cpu import cpu
from gyrfalcon.engine_api.types import EngineRequest, SamplingParams
from tests.conftest import tiny_settings

pytestmark = pytest.mark.skipif(not cpu().avx2, reason="the int4 kernels need AVX2 or AVX-512")

PROMPTS = [[1, 5, 9, 12], [1, 40, 41], [1, 7, 7, 7, 7, 8], [1, 99]]
SEEDED = SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("width", [1536, 100])
def test_silu_mul_gives_atens_bits(width):
    """``silu(gate) · up`` of ``decode_layers.c`` over a layer's rows (``gate`` and ``up`` the two
    halves of a fused product's rows, as the decoder chunks them) equals ``F.silu(gate) * up`` to
    the last bit, far into both tails (where exp under- and overflows): whole pairs of vectors in
    SLEEF's exp, and (a width of 100) the rest of a row in the C library's, as ATen's loop does."""
    kernels = native.library(None)
    torch.manual_seed(0)
    for scale in (1.0, 8.0, 60.0):
        gate, up = (torch.randn(260, 2 * width) * scale).chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        for row in range(gate.shape[0]):
            kernels.silu_mul(gate[row].data_ptr(), up[row].data_ptr(), out[row].data_ptr(), ctypes.c_long(width))
        assert torch.equal(out, want), scale


def _results(engine, together: bool) -> list[tuple[list[int], list]]:
    if together:
        streams = [engine.submit(EngineRequest(f"t{i}", p, SEEDED)) for i, p in enumerate(PROMPTS)]
    else:
        streams = [engine.submit(EngineRequest(f"a{i}", p, SEEDED)) for i, p in enumerate(PROMPTS)]
        streams = [[*s] for s in streams]
    outputs = [list(s)[-1].outputs[0] for s in streams]
    return [(o.token_ids, o.logprobs.logprobs) for o in outputs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float32", "bfloat16", "float16"])
def test_the_layer_loop_serves_the_operators_bits(tiny_model_dir, kv_cache_dtype):
    """With int4 layers (the tiny model quantised at load, as a GGUF's are kept), decode steps run
    their layers in one call of ``decode_layers.c`` — nothing compiled — and seeded requests, alone
    and together, get the operator-by-operator engine's tokens and log-probabilities bit for bit
    (fp32, bf16 and fp16 caches: the new keys and values are rounded as ``.to(dtype)`` rounds them;
    ``auto`` beside int4 layers is fp16, llama.cpp's cache for a GGUF)."""
    from gyrfalcon.plugins.engines import create_transformers_engine

    settings = dict(quantization="int4", kv_cache_dtype=kv_cache_dtype)
    operators = create_transformers_engine(tiny_settings(tiny_model_dir, **settings))
    looped = create_transformers_engine(tiny_settings(tiny_model_dir, enforce_eager=False, compile_decode=False,
                                                      **settings))  # fmt: skip
    try:
        assert operators.wait_ready(timeout=60).ready and looped.wait_ready(timeout=60).ready
        assert operators.core.decode_path.name == "eager"
        assert looped.core.decode_path.name == "native", looped.core.decode_path
        runner = looped.core.runner
        expected_dtype = torch.float16 if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype)
        assert runner.cache.keys[0].dtype == operators.core.runner.cache.keys[0].dtype == expected_dtype
        before = runner.forwards
        expected = _results(operators, together=False)
        assert _results(looped, together=False) == expected
        assert _results(looped, together=True) == expected  # int4 rows: the same bits in any batch
        assert runner.forwards > before
    finally:
        operators.shutdown(grace=1.0)
        looped.shutdown(grace=1.0)


def test_a_layer_loop_that_differs_by_a_bit_does_not_serve(tiny_model_dir, monkeypatch):
    """The check at start-up compares the loop's logits with the operators' to the last bit: a loop
    one ulp off in the hidden states is refused, the operators serve, and the reason is said."""
    from gyrfalcon.plugins.engines import create_transformers_engine

    real = layer_loop.LayerLoop.__call__

    def off_by_a_bit(self, x, positions, step):
        out = real(self, x, positions, step)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(layer_loop.LayerLoop, "__call__", off_by_a_bit)
    engine = create_transformers_engine(tiny_settings(tiny_model_dir, quantization="int4", enforce_eager=False,
                                                      compile_decode=False))  # fmt: skip
    try:
        assert engine.wait_ready(timeout=60).ready
        assert engine.core.decode_path.name == "eager"
        assert engine.core.runner.direct.layer_loop is None
    finally:
        engine.shutdown(grace=1.0)
