"""The engine's C kernels (:mod:`gyrfalcon.kernels.native`): how they are built, and the
mean of squares the norms take (the Q8_0 head's kernel is tested with its layer in test_quantization)."""

from __future__ import annotations

import shutil

import pytest
import torch

from gyrfalcon.kernels import native
from gyrfalcon.engine.model.decoder import _mean_square, _mean_square_in_lanes, mean_square
from gyrfalcon.kernels.quant import q8
from gyrfalcon.kernels.quant.layers import UnsupportedQuantization


def test_the_kernels_build_without_openmp_and_are_refused_without_a_compiler(tmp_path, monkeypatch):
    """A compiler without OpenMP still builds the kernels (on the calling thread alone, the same
    sums); one that fails gets :class:`KernelUnavailable` saying so (the Q8_0 head then refuses,
    so the loader keeps the fp32 head and the start-up line says why), not a half-built library."""
    monkeypatch.setattr(native, "_loaded", [])  # this test's libraries serve this test only
    no_openmp = tmp_path / "cc-without-openmp"
    no_openmp.write_text(f'#!/bin/sh\ncase " $* " in *" -fopenmp "*) echo "no omp.h" >&2; exit 1;; esac\n'
                         f'exec {shutil.which("gcc") or shutil.which("cc")} "$@"\n')  # fmt: skip
    no_openmp.chmod(0o755)
    monkeypatch.setenv("CC", str(no_openmp))
    torch.manual_seed(0)
    table = torch.randint(-127, 128, (40, 64), dtype=torch.int8)
    head, x = q8.Q8Linear(table, torch.full((40, 2), 0.01), None, tmp_path / "single"), torch.randn(5, 64)
    assert torch.allclose(head(x), x @ (0.01 * table.float()).t(), rtol=1e-5, atol=1e-4)
    assert torch.allclose(mean_square(x), x.pow(2).mean(-1, keepdim=True), rtol=1e-5)
    assert len(list((tmp_path / "single").glob("kernels-*.so"))) == 1

    monkeypatch.setattr(native, "_loaded", [])
    monkeypatch.setenv("CC", "false")
    with pytest.raises(native.KernelUnavailable, match="false .* failed"):
        native.library(tmp_path / "kernels")
    with pytest.raises(UnsupportedQuantization, match="false .* failed"):
        q8.Q8Linear(table, torch.full((40, 2), 0.01), None, tmp_path / "kernels")
    assert not list((tmp_path / "kernels").glob("*.so")) and native.loaded() is None
    assert torch.equal(mean_square(x), x.pow(2).mean(-1, keepdim=True))  # no kernels: ATen's


def test_a_library_that_others_could_write_is_built_again_never_loaded(tmp_path):
    """The kernel cache is private: made 0700; a library there that another user could have
    written (group- or world-writable, or not this user's) is built again in a new private folder,
    and a cache folder others may write is not used at all."""
    import os
    import stat

    target = native._build(tmp_path / "kernels")
    assert stat.S_IMODE((tmp_path / "kernels").stat().st_mode) & 0o077 == 0 and native._private(target)
    assert native._build(tmp_path / "kernels") == target  # a private library is used as it is
    target.chmod(0o666)
    rebuilt = native._build(tmp_path / "kernels")
    assert rebuilt != target and rebuilt.name == target.name and native._private(rebuilt)
    assert native._private(rebuilt.parent) and rebuilt.parent != target.parent
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by others"):
        native._build(shared)
    assert not list(shared.iterdir()) and os.access(rebuilt, os.R_OK)


@pytest.mark.parametrize("width", [64, 100, 576, 9000])
def test_a_rows_mean_square_has_the_same_bits_alone_and_in_any_batch(width):
    """``mean_square.c`` sums each row in one order whatever the rows beside it (widths that are
    and are not whole 16-lane vectors, batches small and large enough to be shared between
    threads), agrees with ATen's mean to rounding, and the operator a compiled step calls gives the
    eager call's bits."""
    native.library(None)
    torch.manual_seed(width)
    x = torch.randn(300, width) * 10
    alone = torch.cat([mean_square(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(mean_square(x), alone) and torch.equal(mean_square(x.view(3, 100, width)).view(300, 1), alone)
    assert torch.allclose(alone, x.pow(2).mean(-1, keepdim=True), rtol=1e-5)
    assert not torch.equal(alone, torch.zeros_like(alone))
    assert torch.equal(_mean_square(x[:7]), alone[:7]) and mean_square(x[:0]).shape == (0, 1)
    # the same sums as elementwise operations (what a compiled norm runs; the compiled-step tests
    # hold inductor's code to them)
    assert torch.equal(_mean_square_in_lanes(x), alone)
    torch.library.opcheck(_mean_square, (x[:3],))


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16, torch.float16])
def test_one_query_attention_reads_the_blocks_in_place_as_sdpa_over_their_copy(window, cache):
    """``one_query_attention.c``: each row's heads over its own blocks (scattered, some rows of one
    block, some of many; grouped query heads; a sliding window) agree with SDPA over the gathered
    context, give the same bits alone and in the batch, and the compiled step's operator gives the
    eager call's bits; a bf16 or fp16 cache is read as its values widened to fp32."""
    from gyrfalcon.engine.model.attention import _gather, _sdpa
    from gyrfalcon.engine.model.one_query import _operator, one_query_attention

    native.library(None)
    torch.manual_seed(window)
    block, kv_heads, heads, dim, width = 16, 3, 9, 64, 20
    keys, values = torch.randn(40 * block, kv_heads, dim).to(cache), torch.randn(40 * block, kv_heads, dim).to(cache)
    positions = torch.tensor([0, 15, 16, 100, 319])
    tables = torch.stack([torch.randperm(39)[:width] + 1 for _ in positions])
    q = torch.randn(len(positions), heads, dim) * 2
    out = one_query_attention(q, keys, values, tables, positions, block, window, 0.125)

    columns = torch.arange(width * block)[None]
    visible = (columns <= positions[:, None]) & ((columns > positions[:, None] - window) if window else True)
    expected = _sdpa(q.unsqueeze(2), _gather(keys, tables, block, torch.float32), _gather(values, tables, block, torch.float32),
                     visible[:, None, None, :], 0.125)[:, 0]  # fmt: skip
    assert torch.allclose(out, expected, atol=2e-6) and out.abs().max() > 0.1
    alone = [one_query_attention(q[i : i + 1], keys, values, tables[i : i + 1], positions[i : i + 1], block, window, 0.125)
             for i in range(len(positions))]  # fmt: skip
    assert torch.equal(torch.cat(alone), out)
    assert torch.equal(_operator(q, keys, values, tables, positions, block, window, 0.125), out)
    torch.library.opcheck(_operator, (q[:2], keys, values, tables[:2], positions[:2], block, window, 0.125))


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("cache", [torch.float32, torch.float16])
def test_a_prefills_groups_read_the_blocks_in_place_as_sdpa_over_their_copy(window, cache):
    """``prefill_attention.c``: a segment's rows (starting mid-block, scattered blocks, grouped query
    heads, a sliding window) agree with SDPA over the gathered context; rows of one-row groups are
    left to the decode rows' kernel; each row's bits are the same whether its prompt came in one
    segment or two, on one thread or two."""
    from gyrfalcon.engine.model.attention import _gather, _sdpa, block_groups
    from gyrfalcon.engine.model.one_query import RowsInPlace

    native.library(None)
    torch.manual_seed(window + 1)
    block, kv_heads, heads, dim, start, count = 16, 3, 9, 64, 5, 140
    keys, values = torch.randn(40 * block, kv_heads, dim).to(cache), torch.randn(40 * block, kv_heads, dim).to(cache)
    table = torch.randperm(39)[: -(-(start + count) // block)] + 1
    q = torch.randn(count, heads, dim) * 2
    kernel = RowsInPlace.of(keys, values, block, window, 0.125, dim)

    def groups(first: int, rows: int) -> list[tuple[int, int]]:
        return [(a, b) for a, b in block_groups(first, rows, block) if b - a > 1]

    out = torch.full((count, heads, dim), float("nan"))
    kernel.prefill(q, table, start, out, groups(start, count))

    positions = torch.arange(start, start + count)[:, None]
    columns = torch.arange(len(table) * block)[None]
    visible = (columns <= positions) & ((columns > positions - window) if window else True)
    expected = _sdpa(q.transpose(0, 1)[None], _gather(keys, table[None], block, torch.float32),
                     _gather(values, table[None], block, torch.float32), visible[None, None], 0.125)[0]  # fmt: skip
    single = [first - start for first, stop in block_groups(start, count, block) if stop - first == 1]
    many = torch.ones(count, dtype=torch.bool)
    many[single] = False
    assert single and out[~many].isnan().all()  # position 144 falls alone at the last block's start
    assert torch.allclose(out[many], expected[many], atol=2e-6) and out[many].abs().max() > 0.1
    cut = 3 * block - start  # a chunk boundary on a block's edge, as the scheduler cuts prompts
    halves = torch.full_like(out, float("nan"))
    kernel.prefill(q[:cut], table, start, halves[:cut], groups(start, cut))
    kernel.prefill(q[cut:], table, start + cut, halves[cut:], groups(start + cut, count - cut))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.full_like(out, float("nan"))
        kernel.prefill(q, table, start, alone, groups(start, count))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(halves[many], out[many]) and torch.equal(alone[many], out[many])


@pytest.mark.skipif(not __import__("gyrfalcon.kernels.native.cpu", fromlist=["cpu"]).cpu().avx512,
                    reason="needs an AVX-512 CPU to run both builds (on an AVX2 one the AVX2 build is the one tested)")
def test_the_int4_kernels_give_the_same_bits_built_for_avx2_and_for_avx_512(tmp_path):
    """``q4_linear.c`` and ``q4q8_linear.c`` sum every output in the same order whatever the vector
    width: the library built for AVX2 alone (the flags an AVX2-only CPU gets) and the one built for
    this AVX-512 CPU give the same bits, so a model's tokens do not depend on the CI runner's kind."""
    import ctypes
    import subprocess

    from gyrfalcon.kernels.quant.q4 import KERNELS, pack
    from gyrfalcon.kernels.quant.weights import Int4Weights

    cc = native._compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    flags = ["-O3", "-shared", "-fPIC", "-ffp-contract=fast", "-fopenmp"]
    builds = [ctypes.CDLL(str(native._compile(cc, version, [*flags, *isa], tmp_path / name)))
              for name, isa in (("avx2", ["-mavx2", "-mfma", "-mf16c"]), ("avx512", native._isa_flags()))]  # fmt: skip
    weights = Int4Weights.quantize(torch.randn(64, 96, generator=torch.Generator().manual_seed(1)))
    for inputs, kernel in KERNELS.items():
        nibbles, scales = pack(weights, inputs)
        for rows in (1, 3, 7, 130):
            x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
            outs = []
            for build in builds:
                out = torch.empty(rows, 64)
                status = getattr(build, kernel)(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(nibbles.data_ptr()),
                                                ctypes.c_void_p(scales.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                                                ctypes.c_long(rows), ctypes.c_long(64), ctypes.c_long(96), ctypes.c_int(2))  # fmt: skip
                assert status == 0
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), (kernel, rows)


def test_only_a_thread_that_steps_an_engine_opens_teams_of_the_kernels():
    """While a thread steps an engine, a kernel called from any other thread (a load, a swap, a
    background compile) runs on one thread: a team opened there would throttle the step loop's
    barriers. With no engine stepping, every thread gets torch's count (benchmarks, tests)."""
    import threading

    import torch

    from gyrfalcon.kernels import native as kernels

    seen = []
    elsewhere = threading.Thread(target=lambda: seen.append(kernels.threads()))
    assert kernels.threads() == torch.get_num_threads()
    with kernels.stepping():
        assert kernels.threads() == torch.get_num_threads()
        elsewhere.start()
        elsewhere.join()
    assert seen == [1] and kernels.threads() == torch.get_num_threads()
