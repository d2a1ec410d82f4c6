"""LoRA adapters (``--enable-lora``): a PEFT folder served by name computes what the base model with
the adapter merged into its weights computes, alone and in a batch beside other adapters and the
base model; a folder that cannot serve is refused naming why."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gyrfalcon.engine.lora.peft import AdapterError, read_adapter
from gyrfalcon.engine_api.types import EngineRequest, SamplingParams
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.conftest import tiny_settings

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


def _safetensors(header: dict, data_bytes: int) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + bytes(data_bytes)


def projection_shapes(base: str) -> dict[tuple[int, str], tuple[int, int]]:
    """``(layer, module)`` → ``(out, in)`` of ``base``'s projections, as the registry takes them."""
    weights = load_file(str(Path(base) / "model.safetensors"))
    return {(int(key.split(".")[2]), key.split(".")[4]): tuple(t.shape) for key, t in weights.items()
            if key.startswith("model.layers.") and key.split(".")[4] in TARGETS}  # fmt: skip


def write_adapter(base: str, out: Path, seed: int, rank: int = 4, alpha: float = 8.0, targets=TARGETS, **config) -> Path:
    """A PEFT folder of random factors over ``base``'s projections (as training a few steps leaves
    them: both factors non-zero)."""
    weights = load_file(str(Path(base) / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    layers = sorted({int(k.split(".")[2]) for k in weights if k.startswith("model.layers.")})
    for layer in layers:
        for module in targets:
            out_features, in_features = weights[f"model.layers.{layer}.{PARENT[module]}.{module}.weight"].shape
            prefix = f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.2
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
                "base_model_name_or_path": base, **config}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(settings))
    return out


def train_adapter(base: str, out: Path, prompts: list[list[int]], answer: list[int], rank: int = 8, alpha: float = 16.0,
                  steps: int = 60) -> Path:  # fmt: skip
    """A PEFT folder trained by plain torch (PEFT's start: ``A`` random, ``B`` zero; Adam) on every
    projection of ``base`` until each of ``prompts`` is followed by ``answer`` (teacher forcing)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval().requires_grad_(False)
    generator, scaling, factors, hooks = torch.Generator().manual_seed(0), alpha / rank, {}, []
    for i, layer in enumerate(model.model.layers):
        for module in TARGETS:
            linear = getattr(getattr(layer, PARENT[module]), module)
            a = (torch.randn(rank, linear.in_features, generator=generator) / linear.in_features**0.5).requires_grad_()
            b = torch.zeros(linear.out_features, rank, requires_grad=True)
            factors[f"base_model.model.model.layers.{i}.{PARENT[module]}.{module}"] = (a, b)
            hooks.append(linear.register_forward_hook(lambda m, x, y, a=a, b=b: y + scaling * (x[0] @ a.T) @ b.T))
    optimizer = torch.optim.Adam([t for pair in factors.values() for t in pair], lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = 0.0
        for prompt in prompts:
            ids = torch.tensor([prompt + answer])
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(answer))
        loss.backward()
        optimizer.step()
    for hook in hooks:
        hook.remove()
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"{prefix}.lora_{half}.weight": t.detach().contiguous()
               for prefix, pair in factors.items() for half, t in zip("AB", pair)}  # fmt: skip
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                                                         "target_modules": list(TARGETS), "bias": "none"}))  # fmt: skip
    return out


def merged_model(base: str, adapter: Path, out: Path) -> Path:
    """``base`` with the adapter's ``scaling · B A`` added to each projection's weight."""
    shutil.copytree(base, out)
    weights = load_file(str(Path(base) / "model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    factors = load_file(str(adapter / "adapter_model.safetensors"))
    for key, a in factors.items():
        if ".lora_A." in key:
            name = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            b = factors[key.replace("lora_A", "lora_B")]
            weights[name] = (weights[name].double() + scaling * b.double() @ a.double()).float()
    save_file(weights, str(out / "model.safetensors"))
    return out


GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32, 33]]


def _answers(settings, requests: list[EngineRequest], together: bool) -> list[tuple[list[int], list[float]]]:
    engine = create_transformers_engine(settings)
    try:
        assert engine.wait_ready(60).ready, engine.health().message
        if together:
            streams = [engine.submit(r) for r in requests]
            finals = [list(s)[-1] for s in streams]
        else:
            finals = [list(engine.submit(r))[-1] for r in requests]
        return [(c.token_ids, c.logprobs.logprobs) for f in finals for c in f.outputs]
    finally:
        engine.shutdown(0)


def _close(got, want) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) <= 1e-4


def test_adapters_compute_what_their_merged_weights_compute_alone_and_beside_each_other(tiny_model_dir, tmp_path):
    """Three adapters at vLLM's default --max-loras 1 (two slots): every request gets its merged
    weights' answer, sent one at a time (each adapter read back into the slot used least recently)
    and all at once (a third adapter's requests wait for a slot the others free)."""
    folders = {"first": write_adapter(tiny_model_dir, tmp_path / "first", seed=1),
               "second": write_adapter(tiny_model_dir, tmp_path / "second", seed=2, rank=8, alpha=4.0,
                                       targets=("q_proj", "v_proj", "down_proj")),
               "third": write_adapter(tiny_model_dir, tmp_path / "third", seed=3, targets=("o_proj", "up_proj"))}  # fmt: skip
    plain = dict(quantization="none", max_model_len=128)
    expected = {}
    for name, folder in folders.items():
        merged = merged_model(tiny_model_dir, folder, tmp_path / f"merged-{name}")
        expected[name] = _answers(tiny_settings(str(merged), **plain),
                                  [EngineRequest(f"{name}{i}", p, SamplingParams(**GREEDY)) for i, p in enumerate(PROMPTS)],
                                  together=False)  # fmt: skip
    expected[None] = _answers(tiny_settings(tiny_model_dir, **plain),
                              [EngineRequest(f"base{i}", p, SamplingParams(**GREEDY)) for i, p in enumerate(PROMPTS)],
                              together=False)  # fmt: skip
    assert all(expected[name] != expected[None] for name in folders)  # the adapters change answers
    served = tiny_settings(tiny_model_dir, enable_lora=True, lora_modules=[f"{n}={f}" for n, f in folders.items()],
                           max_lora_rank=8, **plain)  # fmt: skip
    names = [name for name in (*folders, None) for _ in PROMPTS]
    requests = [EngineRequest(f"r{i}", PROMPTS[i % 3], SamplingParams(**GREEDY), lora_name=name) for i, name in enumerate(names)]
    alone = _answers(served, requests, together=False)
    mixed = _answers(served, requests, together=True)  # every adapter and the base model in the same steps
    want = [answer for name in (*folders, None) for answer in expected[name]]
    _close(alone, want)
    _close(mixed, want)


def test_speculation_with_adapters_changes_no_answer(tiny_model_dir, tmp_path):
    """n-gram drafts verified with the adapters' products in the rows: each request's tokens and
    logprobs (seeded and greedy) are the ones it gets without speculation, and drafts were made."""
    from tests.unit.test_speculative import NGRAM

    first = write_adapter(tiny_model_dir, tmp_path / "first", seed=1)
    second = write_adapter(tiny_model_dir, tmp_path / "second", seed=2, targets=("q_proj", "down_proj"))
    lora = dict(quantization="int4", enable_lora=True, lora_modules=[f"first={first}", f"second={second}"], max_loras=2,
                max_model_len=256)  # fmt: skip
    params = [dict(temperature=0.0), dict(temperature=0.8, seed=5)]
    requests = [EngineRequest(f"r{i}-{j}", [5, 6, 7, 8] * 4, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1, **p),
                              lora_name=name) for i, name in enumerate(("first", "second", None)) for j, p in enumerate(params)]  # fmt: skip
    plain = _answers(tiny_settings(tiny_model_dir, **lora), requests, together=False)
    engine = create_transformers_engine(tiny_settings(tiny_model_dir, speculative_config=NGRAM, **lora))
    try:
        assert engine.wait_ready(60).ready
        finals = [list(engine.submit(r))[-1] for r in requests]
        speculated = [(c.token_ids, c.logprobs.logprobs) for f in finals for c in f.outputs]
        assert engine.core.stats()["spec_decode_num_drafts"] > 0
    finally:
        engine.shutdown(0)
    assert speculated == plain


def test_two_adapters_never_share_cached_blocks(tiny_model_dir, tmp_path):
    """A prompt of two full blocks cached by the base model's request is not where an adapter's
    request of the same prompt starts: its KV is the adapter's own (the prefix cache keys by adapter)."""
    first = write_adapter(tiny_model_dir, tmp_path / "first", seed=1)
    long_prompt = [[3 + (7 * i) % 500 for i in range(40)]]
    merged = merged_model(tiny_model_dir, first, tmp_path / "merged")
    plain = dict(quantization="none", max_model_len=128)
    want = _answers(tiny_settings(str(merged), **plain), [EngineRequest("m", long_prompt[0], SamplingParams(**GREEDY))],
                    together=False)  # fmt: skip
    served = tiny_settings(tiny_model_dir, enable_lora=True, lora_modules=[f"first={first}"], **plain)
    base, adapted = _answers(served, [EngineRequest("b", long_prompt[0], SamplingParams(**GREEDY)),
                                      EngineRequest("a", long_prompt[0], SamplingParams(**GREEDY), lora_name="first")],
                             together=False)  # fmt: skip
    _close([adapted], want)
    assert base[0] != adapted[0] or base[1] != adapted[1]


def test_int4_decode_steps_with_adapters_run_in_the_layer_loop_to_the_operators_bits(tiny_model_dir, tmp_path):
    """With int4 layers, a step of decode rows over two adapters and the base model runs its layers
    in one call of ``decode_layers.c`` (the adapters' products by ``lora_add.c`` inside it) and gives
    the operator-by-operator engine's tokens and log-probabilities bit for bit; and each row's bits
    are its own, alone or beside the others (each product summed in one fixed order)."""
    first = write_adapter(tiny_model_dir, tmp_path / "first", seed=1)
    second = write_adapter(tiny_model_dir, tmp_path / "second", seed=2, rank=8, alpha=4.0, targets=("q_proj", "down_proj"))
    lora = dict(quantization="int4", enable_lora=True, lora_modules=[f"first={first}", f"second={second}"], max_loras=2,
                max_lora_rank=8)  # fmt: skip
    seeded = dict(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True, logprobs=2)
    names = [name for name in ("first", "second", None) for _ in PROMPTS]
    requests = [EngineRequest(f"r{i}", PROMPTS[i % 3], SamplingParams(**seeded), lora_name=name) for i, name in enumerate(names)]
    operators = _answers(tiny_settings(tiny_model_dir, **lora), requests, together=False)
    looped = tiny_settings(tiny_model_dir, enforce_eager=False, compile_decode=False, **lora)
    engine = create_transformers_engine(looped)
    try:
        assert engine.wait_ready(60).ready and engine.core.decode_path.name == "native", engine.core.decode_path
    finally:
        engine.shutdown(0)
    assert _answers(looped, requests, together=False) == operators
    assert _answers(looped, requests, together=True) == operators


@pytest.mark.parametrize(("change", "why"), [
    (dict(rank=32), "above --max-lora-rank 16"),
    (dict(bias="all"), "bias 'all' is not served"),
    (dict(use_dora=True), "use_dora True is not served"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
])  # fmt: skip
def test_a_folder_that_cannot_serve_is_refused_naming_why(tiny_model_dir, tmp_path, change, why):
    rank = change.pop("rank", 4)
    folder = write_adapter(tiny_model_dir, tmp_path / "bad", seed=3, rank=rank, **change)
    shapes = {(layer, module): (64, 64) for layer in range(2) for module in TARGETS}
    with pytest.raises(AdapterError, match=why):
        read_adapter("bad", str(folder), shapes, max_rank=16)


def test_an_adapter_of_another_shape_or_module_is_refused(tiny_model_dir, tmp_path):
    folder = write_adapter(tiny_model_dir, tmp_path / "ok", seed=4)
    shapes = {}
    for key, tensor in load_file(str(Path(tiny_model_dir) / "model.safetensors")).items():
        parts = key.split(".")
        if len(parts) == 6 and parts[4] in TARGETS:
            shapes[(int(parts[2]), parts[4])] = tuple(tensor.shape)
    assert len(read_adapter("ok", str(folder), shapes, max_rank=16).factors) == 14
    narrower = {key: (out, inp * 2) for key, (out, inp) in shapes.items()}
    with pytest.raises(AdapterError, match="do not fit"):
        read_adapter("ok", str(folder), narrower, max_rank=16)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="lm_head"):
        read_adapter("ok", str(folder), shapes, max_rank=16)


@pytest.mark.parametrize(("content", "why"), [
    (b"abc", "not a safetensors file"),
    (struct.pack("<Q", 10**9), "header runs past the end"),
    (struct.pack("<Q", 5) + b"[1,2]", "header is not a JSON object"),
    (_safetensors({"x": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]}}, 4), "dtype 'I8' is not served"),
    (_safetensors({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8), "do not hold \\[4\\] F32"),
    (_safetensors({"x": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}}, 16), "shape \\[-1, 4\\] is not a list of whole"),
    (_safetensors({"x": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, 4), "is not a list of whole numbers"),
    (_safetensors({"x": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}, 4), "is not a list of whole numbers"),
    (_safetensors({"x": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}, 4), "is not a list of whole numbers"),
    (_safetensors({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}}, 4), "not whole numbers"),
    (_safetensors({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 4), "bytes 0..8 do not hold"),
    (_safetensors({"x": {"dtype": "F32", "shape": [1]}}, 4), "its entry has no 'data_offsets'"),
    (_safetensors({"x": [1, 2]}, 4), "its entry is not a JSON object"),
])  # fmt: skip
def test_a_weights_file_that_is_not_safetensors_is_refused_naming_why(tiny_model_dir, tmp_path, content, why):
    folder = write_adapter(tiny_model_dir, tmp_path / "bad", seed=3)
    (folder / "adapter_model.safetensors").write_bytes(content)
    with pytest.raises(AdapterError, match=why):
        read_adapter("bad", str(folder), {}, max_rank=16)


def test_a_header_checked_for_an_earlier_file_is_checked_again_against_this_files_size_and_rank(tiny_model_dir,
                                                                                              tmp_path):  # fmt: skip
    """Headers are checked once per header (a trainer's versions of an adapter share theirs): a file
    with the bytes of a header served before still has its size and its config's rank checked."""
    shapes = projection_shapes(tiny_model_dir)
    good = write_adapter(tiny_model_dir, tmp_path / "good", seed=1)
    assert read_adapter("good", str(good), shapes, max_rank=8, factors=False).rank == 4
    cut = shutil.copytree(good, tmp_path / "cut")
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[:-4])
    with pytest.raises(AdapterError, match="do not hold"):
        read_adapter("cut", str(cut), shapes, max_rank=8, factors=False)
    other_rank = shutil.copytree(good, tmp_path / "other_rank")
    config = json.loads((other_rank / "adapter_config.json").read_text())
    (other_rank / "adapter_config.json").write_text(json.dumps({**config, "r": 2}))
    with pytest.raises(AdapterError, match="do not fit"):
        read_adapter("other_rank", str(other_rank), shapes, max_rank=8, factors=False)


def test_unknown_adapters_and_flags_that_cannot_serve(tiny_model_dir, tmp_path):
    from gyrfalcon.config import Settings
    from gyrfalcon.errors import Kind, RequestError

    with pytest.raises(ValueError, match="needs --enable-lora"):
        Settings(model=tiny_model_dir, lora_modules=["a=/x"]).validate()
    with pytest.raises(ValueError, match="--max-cpu-loras \\(1\\) must be at least --max-loras \\(2\\)"):
        Settings(model=tiny_model_dir, enable_lora=True, max_loras=2, max_cpu_loras=1).validate()
    Settings(model=tiny_model_dir, enable_lora=True, lora_modules=["a=/x", "b=/y"]).validate()  # (vLLM's: more than --max-loras)
    for module, why in (('{"name": "a"}', "needs a name and a path"), ('{"name": "a", "path": "/x", "rank": 8}', "rank not served"),
                        ('{"name": "a", "path": "/x", "base_model_name": "other"}', "base_model_name 'other' is not a served"),
                        ('{"name": ', "is not a JSON object")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            Settings(model=tiny_model_dir, enable_lora=True, lora_modules=[module], served_model_name=["tiny"]).validate()
    with pytest.raises(ValueError, match="is not NAME=PATH"):
        Settings(model=tiny_model_dir, enable_lora=True, lora_modules=["a"]).validate()
    engine = create_transformers_engine(tiny_settings(tiny_model_dir, enable_lora=True))
    try:
        assert engine.wait_ready(60).ready
        with pytest.raises(RequestError, match="does not exist") as err:
            engine.submit(EngineRequest("x", [5, 6], SamplingParams(max_tokens=2), lora_name="nobody"))
        assert (err.value.param, err.value.type) == ("model", Kind.NOT_FOUND)
    finally:
        engine.shutdown(0)


def test_unloading_ends_the_requests_waiting_for_the_adapter_and_lets_the_running_finish(tiny_model_dir, tmp_path):
    from gyrfalcon.errors import Kind

    first = write_adapter(tiny_model_dir, tmp_path / "first", seed=1)
    engine = create_transformers_engine(tiny_settings(tiny_model_dir, enable_lora=True, lora_modules=[f"first={first}"],
                                                      max_num_seqs=1), start=False)  # fmt: skip
    try:
        assert engine.core.prepare()
        running = engine.submit(EngineRequest("run", [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True), lora_name="first"))
        engine.core.batcher.step()  # it runs (one sequence at a time)
        waiting = engine.submit(EngineRequest("wait", [8, 9], SamplingParams(max_tokens=6, ignore_eos=True), lora_name="first"))
        stats = engine.stats()  # what /metrics' lora_requests_info says
        assert (stats["lora_running_adapters"], stats["lora_waiting_adapters"], stats["lora_max"]) == ("first", "first", 1)
        engine.unload_lora_adapter("first")
        while engine.core.batcher.step():
            pass
        (failed,) = list(waiting)
        assert failed.error is not None and failed.error.type == Kind.NOT_FOUND and "unloaded" in failed.error.message
        assert len(list(running)[-1].outputs[0].token_ids) == 6
    finally:
        engine.shutdown(0)


def test_an_adapters_factors_are_laid_into_its_slot_alike_in_c_and_by_numpy(tiny_model_dir, tmp_path, monkeypatch):
    """``lora_read`` (``lora_add.c``, an fp32 file read straight into the slot) writes an adapter's
    slot of the stacks — ``A`` as it is, ``B`` transposed times the scaling (rank 8: in tiles of
    8 x 8; rank 3: a value at a time), zeros past its rank and for projections it has no factors
    for — with the bits the numpy pass writes (what a slot last held is overwritten)."""
    from gyrfalcon.engine.lora import registry as registries
    from gyrfalcon.kernels import native

    native.library(None)
    shapes = projection_shapes(tiny_model_dir)
    full = write_adapter(tiny_model_dir, tmp_path / "full", seed=1, rank=8, alpha=7.0)
    some = write_adapter(tiny_model_dir, tmp_path / "some", seed=2, rank=3, alpha=5.0, targets=("q_proj", "down_proj"))
    stacks = []
    for kernels in (native.loaded, lambda: None):
        monkeypatch.setattr(registries, "loaded", kernels)
        registry = registries.LoraRegistry(shapes, max_loras=2, max_rank=8, device="cpu")
        for stack in registry.stacks.values():  # what an earlier adapter left in the slots
            for t in stack:
                t.normal_(generator=torch.Generator().manual_seed(0))
        for name, folder in (("full", full), ("some", some)):
            registry.load(name, str(folder))
        stacks.append([t.clone() for pair in registry.stacks.values() for t in pair])
    assert all(torch.equal(a, b) for a, b in zip(*stacks))
    k_proj = list(shapes).index((0, "k_proj"))
    assert stacks[0][2 * k_proj][8:16].abs().sum() == 0  # "some" (slot 1) has no k_proj: its rows all zero
    q_proj = stacks[0][2 * list(shapes).index((0, "q_proj"))]
    assert q_proj[8 + 3 : 16].abs().sum() == 0 < q_proj[8:11].abs().sum()  # zero past rank 3


@pytest.mark.parametrize(("out", "rank"), [(13, 8), (24, 16), (17, 3)])
def test_lora_pack_lays_b_transposed_and_scaled_as_numpy_does_past_the_tiles(out, rank):
    """``lora_pack``'s ``B`` transposed times the scaling in 8 x 8 tiles, and the outputs past the
    last tile (``out`` not a multiple of 8) or a rank not a multiple of 8 a value at a time: the bits
    of numpy's ``b.T * scaling``; ``A`` as it is, the rows past the rank zero."""
    import numpy as np

    from gyrfalcon.kernels import native

    kernels = native.library(None)
    rng = np.random.default_rng(out * rank)
    ins, max_rank, scaling = 11, 16, np.float32(0.37)
    a, b = rng.standard_normal((rank, ins), dtype=np.float32), rng.standard_normal((out, rank), dtype=np.float32)
    a_stack = rng.standard_normal((2 * max_rank, ins), dtype=np.float32)  # (what an earlier adapter left)
    bt_stack = rng.standard_normal((2 * max_rank, out), dtype=np.float32)
    pointers = [np.array([x.ctypes.data], dtype=np.uint64) for x in (a, b, a_stack, bt_stack)]
    widths = np.array([ins], dtype=np.int64), np.array([out], dtype=np.int64)
    assert kernels.lora_pack(1, *(p.ctypes.data for p in pointers), widths[0].ctypes.data, widths[1].ctypes.data,
                             max_rank, rank, max_rank, float(scaling), 1) == 0  # fmt: skip
    assert np.array_equal(a_stack[max_rank : max_rank + rank], a) and not a_stack[max_rank + rank :].any()
    assert np.array_equal(bt_stack[max_rank : max_rank + rank], b.T * scaling) and not bt_stack[max_rank + rank :].any()
    assert kernels.lora_pack(1, *(p.ctypes.data for p in pointers), widths[0].ctypes.data, widths[1].ctypes.data,
                             0, max_rank + 1, max_rank, float(scaling), 1) != 0  # a rank above the slot's: refused


def test_the_rows_of_a_captured_step_compute_every_projection_from_their_slots_buffer(tiny_model_dir, tmp_path):
    """A CUDA graph captures a decode step once, before any adapter is loaded, and replays it with
    other rows: its rows (:meth:`LoraRows.static` on CUDA) compute every projection, the mask made
    again from the slots buffer after each fill, and add what the eager rows of the same adapters
    add (here on the CPU, through the same masked matmuls, in bf16)."""
    from gyrfalcon.engine.lora.registry import LoraRegistry
    from gyrfalcon.engine.lora.step import LoraRows

    shapes = projection_shapes(tiny_model_dir)
    registry = LoraRegistry(shapes, max_loras=2, max_rank=8, device="cpu")
    rows = LoraRows(torch.full((3,), -1, dtype=torch.long), 8, registry.stacks, registry.active, "cpu",
                    every_projection=True)  # fmt: skip
    out, inp = shapes[(0, "q_proj")]
    x = torch.randn(3, inp, generator=torch.Generator().manual_seed(0))
    before = torch.zeros(3, out, dtype=torch.bfloat16)
    rows.add(before, x, 0, "q_proj")  # what the capture computes: no adapter yet
    assert not before.any()
    adapter = registry.load("q", str(write_adapter(tiny_model_dir, tmp_path / "q", seed=4, targets=("q_proj",))))
    rows.fill([adapter, None, adapter])
    captured, eager = torch.zeros(3, out, dtype=torch.bfloat16), torch.zeros(3, out, dtype=torch.bfloat16)
    rows.add(captured, x, 0, "q_proj")
    LoraRows.of([(adapter, 0, 1), (None, 1, 1), (adapter, 2, 1)], "cpu").add(eager, x, 0, "q_proj")
    assert torch.equal(captured, eager) and captured[0].any() and captured[2].any() and not captured[1].any()
    untargeted = torch.zeros(3, shapes[(0, "k_proj")][0], dtype=torch.bfloat16)
    rows.add(untargeted, x, 0, "k_proj")  # computed (zeros in every slot), adds nothing
    assert not untargeted.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_adapter_is_served_as_its_exact_fp32_values(tiny_model_dir, tmp_path, dtype):
    """PEFT often saves adapters in the model's 16-bit dtype: such a file (read into numpy, then laid
    out) fills a slot with exactly what the same values saved in fp32 (read straight into the slot) do."""
    from gyrfalcon.engine.lora.registry import LoraRegistry
    from gyrfalcon.kernels import native

    native.library(None)
    shapes = projection_shapes(tiny_model_dir)
    source = write_adapter(tiny_model_dir, tmp_path / "source", seed=5, rank=4)
    tensors = load_file(str(source / "adapter_model.safetensors"))
    for name, convert in (("half", lambda t: t.to(dtype)), ("wide", lambda t: t.to(dtype).float())):
        shutil.copytree(source, tmp_path / name)
        save_file({k: convert(t).contiguous() for k, t in tensors.items()}, str(tmp_path / name / "adapter_model.safetensors"))
    stacks = []
    for name in ("half", "wide"):
        registry = LoraRegistry(shapes, max_loras=1, max_rank=8, device="cpu")
        registry.load(name, str(tmp_path / name))
        stacks.append([t.clone() for pair in registry.stacks.values() for t in pair])
    assert all(torch.equal(a, b) for a, b in zip(*stacks)) and any(t.abs().sum() > 0 for t in stacks[0])


def test_a_weights_file_written_again_between_its_header_and_its_data_is_refused(tiny_model_dir, tmp_path):
    """The header is read (and checked) first, the factors later, straight into a slot: if the file
    was written again meanwhile (a trainer saving the next version), the load is refused, the slot
    given back, rather than old offsets served over new bytes."""
    from gyrfalcon.engine.lora.registry import LoraRegistry
    from gyrfalcon.kernels import native

    native.library(None)
    shapes = projection_shapes(tiny_model_dir)
    folder = write_adapter(tiny_model_dir, tmp_path / "a", seed=1)
    registry = LoraRegistry(shapes, max_loras=1, max_rank=8, device="cpu")
    adapter = read_adapter("a", str(folder), shapes, max_rank=8, factors=False)
    write_adapter(tiny_model_dir, tmp_path / "a", seed=2, rank=2)  # the next version, other offsets
    with registry._lock:
        slot = registry._reserve(frozenset(), evict=False)
    with pytest.raises(AdapterError, match="changed while it was read"):
        registry._fill(adapter, slot)
    assert not registry._reserved
    assert registry.load("a", str(folder)).rank == 2  # read again whole, it serves
