"""Weight-only quantisation: the layouts, the torch-kernel layers, ``--quantization`` on the tiny model."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.kernels.native.cpu import cpu
from gyrfalcon.kernels.quant.apply import quantize_model, resolve_quantization
from gyrfalcon.kernels.quant.layers import (CastLinear, Int4Linear, Int8Linear, PackedLinear, TiedEmbedding,
                                                 UnsupportedQuantization,
                                                 fuse_outputs)
from gyrfalcon.kernels.quant.q4 import ROUNDED, Q4Linear, pack, q4_inputs, q4_kernel
from gyrfalcon.kernels.quant.q8 import Q8Embedding
from gyrfalcon.kernels.quant.weights import Int4Weights, Int8Weights, relative_error

CPU = torch.device("cpu")


def _weight(n: int = 64, k: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_int4_weights_follow_q4_1s_rule_and_survive_the_disk_layout():
    w = _weight()
    q = Int4Weights.quantize(w)
    assert q.q.dtype == torch.uint8 and int(q.q.max()) <= 15 and q.scale.shape == (64, 3)
    # each group's minimum is q = 0, kept in fp16 as a GGUF keeps it: exact to fp16's rounding
    assert q.scale.dtype == q.minimum.dtype == torch.float16
    low = w.reshape(64, 3, 32).amin(-1)
    assert torch.equal(q.dequantize().reshape(64, 3, 32).amin(-1), low.half().float())
    assert 0 < relative_error(w, q.dequantize()) < 0.1
    back = Int4Weights.from_nibbles(q.packed_nibbles(), q.scale, q.minimum)
    assert torch.equal(back.q, q.q)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantised_layer_computes_its_dequantised_weight_and_each_row_alone(kind, dtype):
    w, bias, x = _weight(), torch.randn(64), torch.randn(5, 7, 96)
    if kind == "int4":
        weights = Int4Weights.quantize(w)
        layer = Int4Linear(weights, bias, dtype, CPU)
    else:
        weights = Int8Weights.quantize(w)
        layer = Int8Linear(weights, bias, dtype, CPU)
    y = layer(x)
    assert y.shape == (5, 7, 64) and y.dtype == x.dtype  # the stream keeps its dtype
    expected = x.to(dtype).float() @ weights.dequantize().t() + bias
    tolerance = 1e-3 if dtype == torch.float32 else 0.05
    assert (y - expected).abs().max() <= tolerance * expected.abs().max()
    rows = x.reshape(35, 96)
    alone = torch.cat([layer(rows[i : i + 1]) for i in range(35)])
    assert torch.equal(alone, layer(rows))  # batch-invariant: bit for bit


def test_the_packed_fp32_head_computes_each_row_alone_and_keeps_its_weight():
    """The fp32 head beside quantised layers (oneDNN over a reordered weight): every row the same
    bits at any row count, the plain product within fp32's rounding, the model's own weight kept
    where a tied embedding reads it; a bf16 weight is refused."""
    linear = torch.nn.Linear(96, 1000, bias=False)
    head, x = PackedLinear(linear.weight), torch.randn(19, 96)
    alone = torch.cat([head(x[i : i + 1]) for i in range(19)])
    for count in (2, 3, 4, 5, 8, 16, 17, 19):
        assert torch.equal(head(x[:count]), alone[:count])
    assert torch.allclose(alone, linear(x), rtol=1e-4, atol=1e-4)
    assert head.weight is linear.weight and head(x.view(19, 1, 96)).shape == (19, 1, 1000)
    assert not hasattr(PackedLinear(linear.weight, keep_weight=False), "weight")  # only the kernel's copy
    with pytest.raises(UnsupportedQuantization):
        PackedLinear(torch.nn.Linear(96, 10).to(torch.bfloat16).weight)


def test_a_q8_0_embedding_looks_up_exactly_the_dequantised_rows():
    """A GGUF's Q8_0 table (int8, an fp16 scale per 32) as an embedding: each looked-up row is the
    dequantised table's row bit for bit, in the stream's dtype, at any ids' shape."""
    q8 = torch.randint(-127, 128, (50, 96), dtype=torch.int8)
    scale8 = (torch.rand(50, 3) * 0.01).to(torch.float16)
    table = (scale8.float()[..., None] * q8.reshape(50, 3, 32).float()).reshape(50, 96)
    embedding = Q8Embedding(q8, scale8, torch.float32)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert embedding(ids).shape == (2, 3, 96) and torch.equal(embedding(ids), table[ids])
    assert torch.equal(embedding.weight, table) and embedding.q8.dtype == torch.int8


def test_the_q8_0_head_gives_each_row_the_same_bits_at_any_row_count(tmp_path):
    """The Q8_0 head (``q8_linear.c``): every row the same bits alone and in batches of every size
    around its tiles (6 input rows on AVX2, 12 on AVX-512; 50 outputs leave a partial panel of 16), the dequantised
    product within fp32's rounding, the bias added, the table's rows dequantised exactly for a tied
    embedding, and the operator a compiled step calls agreeing with its fake."""
    from gyrfalcon.kernels.quant.q8 import Q8Linear, _q8_linear

    torch.manual_seed(0)
    q8 = torch.randint(-127, 128, (50, 96), dtype=torch.int8)
    scale8 = (torch.rand(50, 3) * 0.01).to(torch.float16)
    table = (scale8.float()[..., None] * q8.reshape(50, 3, 32).float()).reshape(50, 96)
    bias = torch.randn(50)
    head, x = Q8Linear(q8, scale8, bias, tmp_path), torch.randn(19, 96)
    alone = torch.cat([head(x[i : i + 1]) for i in range(19)])
    for count in range(2, 20):
        assert torch.equal(head(x[:count]), alone[:count])
    assert torch.allclose(alone, x @ table.t() + bias, rtol=1e-5, atol=1e-4)
    assert head(x.view(19, 1, 96)).shape == (19, 1, 50) and head(x[:0]).shape == (0, 50)
    ids = torch.tensor([[4, 0], [49, 4]])
    assert torch.equal(head.rows(ids, torch.float32), table[ids])
    torch.library.opcheck(_q8_linear, (x[:3], head.q8, head.scale, head.out_features))


@pytest.mark.parametrize("inputs", [torch.int8, torch.int16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 200])
def test_the_int4_kernels_give_each_row_the_same_bits_alone_and_the_product_of_their_inputs(rows, inputs):
    """``q4q8_linear.c`` (inputs rounded to int8 per block of 32, or to 15 bits in two int8 parts) and
    ``q4_linear.c`` (fp32 inputs):
    the GGUF layout's weights dequantised exactly (fp16 scales and minimums), each row the same
    bits alone and among any number of others (their register tiles, the fp32 kernel's buffered
    path from 6 rows on, chunks of 64 and 128 rows), and the product of the exact weights with the
    inputs as the kernel reads them."""
    weights = Int4Weights.quantize(_weight(48, 96, rows))
    bias = torch.randn(48)
    layer = Q4Linear(weights, bias, None, inputs)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    y = layer(x)
    read = ROUNDED[inputs](x) if inputs in ROUNDED else x
    want = read.double() @ weights.dequantize().double().t() + bias.double()
    assert y.dtype == torch.float32 and float((y.double() - want).abs().max()) < 2e-5 * float(want.abs().max())
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(layer(x[i : i + 1]), y[i : i + 1])
    assert torch.equal(layer(x.view(rows, 1, 96)).view(rows, 48), y)  # any leading shape
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_q4_linear_refuses_what_it_cannot_take():
    with pytest.raises(UnsupportedQuantization, match="fp16"):
        Q4Linear(Int4Weights(torch.zeros(16, 32, dtype=torch.uint8), torch.full((16, 1), 0.1), torch.zeros(16, 1)), None, None)
    with pytest.raises(UnsupportedQuantization, match="do not take"):
        Q4Linear(Int4Weights.quantize(_weight(40, 64)), None, None)  # N not a multiple of 16


@pytest.mark.parametrize("kind", ["dense", "int4", "int8", "q4"])
def test_fused_projections_give_each_parts_output_and_share_its_memory(kind):
    """q/k/v (and gate/up) fused into one matmul: the parts' outputs side by side, bit for bit, and
    the parts' weights become views of the fused ones (fusing adds no memory)."""
    widths = (128, 64, 64)  # the CPU int4 layout packs rows in blocks of 64
    weights = [_weight(n, 96, seed) for seed, n in enumerate(widths)]
    biases = [torch.randn(n) for n in widths]
    if kind == "dense":
        parts = [torch.nn.Linear(96, n) for n in widths]
        for part, w, b in zip(parts, weights, biases):
            part.weight.data, part.bias.data = w, b
    elif kind == "int4":
        parts = [Int4Linear(Int4Weights.quantize(w), b, torch.bfloat16, CPU) for w, b in zip(weights, biases)]
    elif kind == "q4":
        parts = [Q4Linear(Int4Weights.quantize(w), b, None, torch.int8) for w, b in zip(weights, biases)]
    else:
        parts = [Int8Linear(Int8Weights.quantize(w), b, torch.bfloat16, CPU) for w, b in zip(weights, biases)]
    x = torch.randn(5, 96)
    with torch.no_grad():
        separate = torch.cat([part(x) for part in parts], -1)
        fused = fuse_outputs(parts)
        assert fused is not None and torch.equal(fused(x), separate)
        assert torch.equal(torch.cat([part(x) for part in parts], -1), separate)  # the parts still work
    name = {"dense": "weight", "int4": "packed", "int8": "q", "q4": "nibbles"}[kind]
    start, end = getattr(fused, name).data_ptr(), getattr(fused, name).data_ptr() + getattr(fused, name).nbytes
    assert all(start <= getattr(part, name).data_ptr() < end for part in parts)
    mixed = [parts[0], torch.nn.Linear(96, 32)] if kind != "dense" else [parts[0], torch.nn.Linear(64, 32)]
    assert fuse_outputs(mixed) is None  # different kinds or input sizes are not fused


def test_int4_parts_whose_packing_ties_their_rows_together_are_left_unfused():
    """torch's CPU int4 layout packs rows in blocks of 64 on AVX-512 and of 32 on AVX2: parts of
    half a block each share one."""
    block = 64 if cpu().avx512 else 32
    parts = [Int4Linear(Int4Weights.quantize(_weight(n, 96, n)), None, torch.bfloat16, CPU) for n in (block, block // 2, block // 2)]
    before = [part.packed for part in parts]
    x = torch.randn(3, 96)
    with torch.no_grad():
        expected = torch.cat([part(x) for part in parts], -1)
        assert fuse_outputs(parts) is None
        assert all(part.packed is old for part, old in zip(parts, before))
        assert torch.equal(torch.cat([part(x) for part in parts], -1), expected)


def test_shapes_and_devices_without_a_kernel_are_refused_loudly():
    with pytest.raises(UnsupportedQuantization, match="does not take"):
        Int4Linear(Int4Weights.quantize(_weight(40, 64)), None, torch.bfloat16, CPU)  # N not a multiple of 16
    with pytest.raises(UnsupportedQuantization, match="no int4"):
        Int4Linear(Int4Weights.quantize(_weight()), None, torch.bfloat16, torch.device("meta"))
    with pytest.raises(UnsupportedQuantization, match="must be one of"):
        resolve_quantization("fp8", False, torch.bfloat16, "cpu")


def test_auto_keeps_a_ggufs_bits_where_the_kernel_is_fast_and_anything_else_as_it_is(monkeypatch):
    from gyrfalcon.kernels.quant import apply

    assert q4_kernel()  # every x86 CPU these tests run on has AVX2 or AVX-512
    assert resolve_quantization("auto", True, torch.float32, "cpu") == "int4"  # our kernels: fp32 rows in
    assert resolve_quantization("auto", True, torch.bfloat16, "cpu") == "int4"
    assert resolve_quantization("auto", False, torch.bfloat16, "cpu") == "none"
    assert resolve_quantization("int8", False, torch.float32, "cpu") == "int8"
    monkeypatch.setattr(apply, "q4_kernel", lambda: False)  # a CPU without it: torch's fp32 path is ~30x slower
    assert resolve_quantization("auto", True, torch.float32, "cpu") == "none"
    assert resolve_quantization("auto", True, torch.bfloat16, "cpu") == "int4"


def test_a_tied_head_and_embedding_share_one_table():
    head = CastLinear(_weight(), None, torch.bfloat16, CPU)
    embedding = TiedEmbedding(head, torch.float32)
    ids = torch.tensor([[3, 0, 63]])
    assert torch.equal(embedding(ids)[0], head.weight[ids[0]].float())
    assert embedding(ids).dtype == torch.float32 and list(embedding.parameters()) == []


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantize_at_load_on_the_tiny_model(tiny_model_dir, mode):
    """An fp32 checkpoint quantised at load: every linear layer swapped, the report says what each
    kind of layer runs in and how far the re-quantisation moved the weights, and the logits stay close."""
    from gyrfalcon.models.loading import load_model, load_weights

    reference = load_model(tiny_model_dir, "float32", "cpu")
    model, report = load_weights(tiny_model_dir, "float32", "cpu", mode)
    linears = [m for m in model.modules() if isinstance(m, (Q4Linear if mode == "int4" else Int8Linear))]
    assert len(linears) == 2 * 7  # two layers of q, k, v, o, gate, up, down
    assert not any(type(m) is torch.nn.Linear and m is not model.lm_head for m in model.modules())
    line = report.describe()
    assert f"--quantization {mode}" in line and "14 quantised at load (largest relative error" in line
    ids = torch.tensor([[1, 17, 33, 250, 7, 90]])
    with torch.inference_mode():
        ours, theirs = model(ids).logits, reference(ids).logits
    assert ours.dtype == torch.float32
    assert relative_error(theirs, ours) < (0.2 if mode == "int4" else 0.05)
    # what quantising left (norms, the head) is the model's own memory: none of it keeps the file mapped
    assert [n for n, p in model.named_parameters() if _in_file_mapping(p, tiny_model_dir)] == []
    assert any(_in_file_mapping(p, tiny_model_dir) for p in reference.parameters())  # the check can see one
    assert load_weights(tiny_model_dir, "float32", "cpu", "auto")[1].mode == "none"  # no GGUF bits: kept as is


def _in_file_mapping(tensor: torch.Tensor, folder) -> bool:
    """Whether ``tensor``'s memory lies in a mapping of a file of ``folder`` (Linux's /proc/self/maps)."""
    address = tensor.untyped_storage().data_ptr()
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) > 5 and fields[5].startswith(str(folder)):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    return True
    return False


def test_quantize_model_refuses_a_device_without_the_kernel(tiny_model_dir):
    from gyrfalcon.models.loading import load_model

    with pytest.raises(UnsupportedQuantization, match="no int4 weight-only kernel on meta"):
        quantize_model(load_model(tiny_model_dir, "float32", "cpu"), "int4", None, torch.bfloat16, "meta")


def test_settings_refuse_an_unknown_quantization():
    from gyrfalcon.config import Settings

    with pytest.raises(ValueError, match="--quantization must be one of auto, none, int4, int8"):
        Settings(quantization="gptq").validate()


@pytest.mark.parametrize("inputs", ["auto", "int8", "int16"])
def test_an_int4_engine_gives_a_request_the_same_tokens_alone_and_in_a_batch(tiny_model_dir, inputs):
    """At the default inputs and with ``--matmul-inputs int8`` or ``int16`` (each row rounded on its own)."""
    from gyrfalcon.engine_api.types import EngineRequest, SamplingParams
    from gyrfalcon.plugins.engines import create_transformers_engine
    from tests.conftest import tiny_settings

    engine = create_transformers_engine(tiny_settings(tiny_model_dir, quantization="int4", matmul_inputs=inputs))
    try:
        assert engine.wait_ready(timeout=60).ready
        assert engine.info().quantization == "int4"
        layers = {m.inputs for m in engine.core.runner.model.modules() if isinstance(m, Q4Linear)}
        assert layers == {q4_inputs() if inputs == "auto" else getattr(torch, inputs)}
        prompts = [[1] + list(range(10 + i, 10 + 3 * i + 2)) for i in range(12)]
        params = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
        streams = [engine.submit(EngineRequest(f"b{i}", p, params)) for i, p in enumerate(prompts)]
        together = [list(s)[-1].outputs[0].token_ids for s in streams]
        alone = [list(engine.submit(EngineRequest(f"a{i}", p, params)))[-1].outputs[0].token_ids for i, p in enumerate(prompts)]
    finally:
        engine.shutdown(grace=1.0)
    assert together == alone
    assert len({tuple(t) for t in together}) > 6


def test_a_kernel_that_does_not_reproduce_its_weights_is_refused(monkeypatch):
    """The probe every layer runs once: a packing the kernel reads differently (here: nibbles
    swapped, as a wrong layout on another device would) is refused at load, never served."""
    aten = torch.ops.aten

    class Ops:
        def __getattr__(self, name):
            if name == "_convert_weight_to_int4pack_for_cpu":
                return lambda q, tiles: aten._convert_weight_to_int4pack_for_cpu(15 - q, tiles)
            return getattr(aten, name)

    monkeypatch.setattr(torch.ops, "aten", Ops())
    with pytest.raises(UnsupportedQuantization, match="does not reproduce its weights"):
        Int4Linear(Int4Weights.quantize(_weight()), None, torch.bfloat16, CPU)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("inputs", [torch.int8, torch.int16, torch.float32])
def test_weights_read_from_a_files_nibbles_pack_as_unpacked_ones_do(inputs, native, monkeypatch):
    """A load packs a GGUF's int4 bits from the file's nibbles without unpacking each weight: the
    same kernel layout, byte for byte, as torch's operators pack the unpacked weights — in one pass
    of ``q4_pack_nibbles`` and ``q4_pack_scales`` (``q4q8_linear.c``), or by the operators where the
    kernels are not loaded."""
    from gyrfalcon.kernels import native as kernels
    from gyrfalcon.kernels.quant import q4

    kernels.library(None)
    generator = torch.Generator().manual_seed(3)
    for n, k in [(16, 32), (64, 576), (1536, 576)]:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
        scale, minimum = (torch.rand(n, k // 32, generator=generator).half() for _ in range(2))
        unpacked = Int4Weights(q, scale, minimum)
        from_file = Int4Weights.from_nibbles(unpacked.packed_nibbles().contiguous(), scale, minimum)
        assert from_file.shape == (n, k) and torch.equal(from_file.q, q)
        with monkeypatch.context() as patched:
            patched.setattr(q4, "loaded", lambda: None)
            want = pack(unpacked, inputs)
            got = pack(from_file, inputs) if not native else None
        got = got if got is not None else pack(from_file, inputs)
        assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_q8_tables_panels_are_laid_out_alike_in_c_and_by_the_operators(monkeypatch):
    """``q8_pack_panels`` (``q8_linear.c``, a weight swap's packing of the head) lays a ``Q8_0``
    table out in the kernel's panels byte for byte as torch's operators do, a last partial panel
    padded with zeros."""
    from gyrfalcon.kernels import native as kernels
    from gyrfalcon.kernels.quant import q8

    kernels.library(None)
    generator = torch.Generator().manual_seed(4)
    for n, k in [(16, 32), (1000, 576), (37, 64)]:
        table = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
        scale = torch.rand(n, k // 32, generator=generator).half()
        native = q8.panels(table, scale)
        with monkeypatch.context() as patched:
            patched.setattr(q8, "loaded", lambda: None)
            operators = q8.panels(table, scale)
        assert all(torch.equal(a, b) for a, b in zip(native, operators))
        assert torch.equal(native[0][-1, :, n % 16 or 16 :], torch.zeros_like(native[0][-1, :, n % 16 or 16 :]))
        assert torch.equal(native[0][:, 5].reshape(-1)[:n], table[:, 5])
