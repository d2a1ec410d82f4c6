"""The decode step's fast path proves itself: compiled on the CPU (the suite's one compile, on the tiny
model), checked against the eager step, dropped with its reason when it fails or differs."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.engine.model.captured import COMPILING, DecodeSteps
from gyrfalcon.engine.model.fast_check import DecodePath, check_fast_step
from gyrfalcon.engine_api.types import EngineRequest, SamplingParams
from tests.conftest import tiny_settings
from tests.unit.test_batching import stepped  # noqa: F401 - fixture

PROMPTS = [[1, 5, 9, 12], [1, 40, 41], [1, 7, 7, 7, 7, 8], [1, 99]]


SEEDED = SamplingParams(temperature=1.0, seed=4, max_tokens=10, ignore_eos=True, logprobs=0)


def _alone(engine) -> list[tuple[list[int], list]]:
    outputs = [list(engine.submit(EngineRequest(f"a{i}", p, SEEDED)))[-1].outputs[0] for i, p in enumerate(PROMPTS)]
    return [(o.token_ids, o.logprobs.logprobs) for o in outputs]


def _together(engine) -> list[tuple[list[int], list]]:
    streams = [engine.submit(EngineRequest(f"t{i}", p, SEEDED)) for i, p in enumerate(PROMPTS)]
    outputs = [list(s)[-1].outputs[0] for s in streams]
    return [(o.token_ids, o.logprobs.logprobs) for o in outputs]


def _ids(results: list[tuple[list[int], list]]) -> list[list[int]]:
    return [ids for ids, _ in results]


@pytest.mark.slow
def test_the_compiled_cpu_step_serves_the_eager_steps_bits(tiny_model_dir, tmp_path, monkeypatch):
    """The CPU engine is ready at once and compiles its batch-1 decode step in the background,
    answering eagerly meanwhile; the compiled step passes its check (the eager step's logits to the
    last bit) and serves — on the tiny model only because the test waives the speed bar (it is not
    faster there) — and seeded requests alone (compiled steps) get the eager engine's tokens and
    log-probabilities, bit for bit, and together (eager batched steps) its tokens. (The tiny model
    is fp32, whose MKL matmuls round a row by its batch: only the default model's kernels promise
    the same bits in any batch, tests/model/test_default_model.py.)"""
    import time

    from torch._dynamo.utils import counters

    from gyrfalcon.engine.model import captured
    from gyrfalcon.plugins.engines import create_transformers_engine

    monkeypatch.setattr(captured, "COMPILED_MUST_TAKE", float("inf"))
    eager = create_transformers_engine(tiny_settings(tiny_model_dir))
    fast = create_transformers_engine(tiny_settings(tiny_model_dir, enforce_eager=False, cache_dir=str(tmp_path)))
    try:
        assert eager.wait_ready(timeout=60).ready and fast.wait_ready(timeout=60).ready
        expected = _alone(eager)
        if fast.core.decode_path.reason == COMPILING:
            assert _ids(_together(fast)) == _ids(expected)  # served eagerly while it compiles
        deadline = time.monotonic() + 300
        while COMPILING in fast.core.decode_path.reason and time.monotonic() < deadline:  # every batch bucket
            time.sleep(0.1)
        path = fast.core.decode_path
        assert path.name == "compiled" and COMPILING not in path.reason, path
        assert fast.health().decode_path == path.describe() == fast.stats()["decode_path"] == fast.info().decode_path
        assert eager.health().decode_path == "eager (--enforce-eager)" == eager.info().decode_path
        steps, frames = fast.core.runner.decode_steps, counters["frames"]["total"]
        runs = sum(b.runs for b in steps._buckets.values() if b.compiled)
        assert _alone(fast) == expected
        assert sum(b.runs for b in steps._buckets.values() if b.compiled) >= runs + 9 * len(PROMPTS)
        assert _ids(_together(fast)) == _ids(expected)
        assert any(b.compiled and b.batch == len(PROMPTS) and b.runs for b in steps._buckets.values())
        assert counters["frames"]["total"] == frames  # serving compiled nothing more (a recompile stalls every request)
    finally:
        eager.shutdown(grace=1.0)
        fast.shutdown(grace=1.0)


@pytest.mark.slow
def test_the_compiled_cpu_step_serves_adapters_to_the_eager_steps_bits(tiny_model_dir, tmp_path, monkeypatch):
    """With ``--enable-lora`` the compiled decode step takes each row's adapter slot from its
    bucket's static buffer and every projection's adapter products through the ``lora_product``
    operator: seeded requests of two adapters and of the base model get, alone (compiled steps of
    batch 1), the eager engine's tokens and log-probabilities bit for bit, and together (a compiled
    step of batch 4, the adapters mixed) its tokens; serving compiles nothing more."""
    import time

    from torch._dynamo.utils import counters

    from gyrfalcon.engine.model import captured
    from gyrfalcon.plugins.engines import create_transformers_engine
    from tests.unit.test_lora import write_adapter

    monkeypatch.setattr(captured, "COMPILED_MUST_TAKE", float("inf"))
    monkeypatch.setattr(captured, "COMPILED_BATCHES", (1, 4))
    first, second = (write_adapter(tiny_model_dir, tmp_path / name, seed=seed) for name, seed in (("a", 1), ("b", 2)))
    lora = dict(enable_lora=True, lora_modules=[f"a={first}", f"b={second}"], max_loras=2)
    eager = create_transformers_engine(tiny_settings(tiny_model_dir, **lora))
    fast = create_transformers_engine(tiny_settings(tiny_model_dir, enforce_eager=False, cache_dir=str(tmp_path), **lora))
    names = ["a", None, "b", "a"]

    def requests(tag):
        return [EngineRequest(f"{tag}{i}", p, SEEDED, lora_name=n) for i, (p, n) in enumerate(zip(PROMPTS, names))]

    def answers(engine, together):
        if together:
            streams = [engine.submit(r) for r in requests("t")]
            outputs = [list(s)[-1].outputs[0] for s in streams]
        else:
            outputs = [list(engine.submit(r))[-1].outputs[0] for r in requests("a")]
        return [(o.token_ids, o.logprobs.logprobs) for o in outputs]

    try:
        assert eager.wait_ready(timeout=60).ready and fast.wait_ready(timeout=60).ready
        expected = answers(eager, together=False)
        base = list(eager.submit(EngineRequest("base", PROMPTS[0], SEEDED)))[-1].outputs[0]
        assert base.logprobs.logprobs != expected[0][1]  # the adapter changes what the row computes
        deadline = time.monotonic() + 300
        while COMPILING in fast.core.decode_path.reason and time.monotonic() < deadline:
            time.sleep(0.1)
        path = fast.core.decode_path
        assert path.name == "compiled" and COMPILING not in path.reason, path
        steps, frames = fast.core.runner.decode_steps, counters["frames"]["total"]
        assert answers(fast, together=False) == expected
        assert _ids(answers(fast, together=True)) == _ids(expected)
        assert {b.batch for b in steps._buckets.values() if b.compiled and b.runs} == {1, 4}
        assert counters["frames"]["total"] == frames
    finally:
        eager.shutdown(grace=1.0)
        fast.shutdown(grace=1.0)


def _steps(tiny_model_dir, max_batch: int = 4, verdicts=None):
    from gyrfalcon.plugins.engines import create_transformers_engine

    engine = create_transformers_engine(tiny_settings(tiny_model_dir), start=False).core
    assert engine.prepare()
    return DecodeSteps(engine.runner, max_batch, 128, mode="compiled", verdicts=verdicts)


def test_a_compiled_step_that_raises_or_differs_is_dropped_with_its_reason(tiny_model_dir, monkeypatch):
    """Stand-ins for the compiler: one whose step raises, one whose logits are off by 1e-6. Each
    time the engine's decode steps run eagerly and the path says why."""
    steps = _steps(tiny_model_dir)

    def raising(fn, **_):
        def step(*args, **kwargs):
            raise RuntimeError("no C++ compiler found")

        return step

    monkeypatch.setattr(torch, "compile", raising)
    path = steps.prepare()
    assert path == DecodePath("eager", "compiling the decode step failed: RuntimeError: no C++ compiler found")
    assert steps._compiled is None and not any(b.compiled for b in steps._buckets.values())

    steps = _steps(tiny_model_dir)  # off in the last bits only (1e-6): a compiled CPU step must be exact
    monkeypatch.setattr(torch, "compile", lambda fn, **_: lambda *a, **k: fn(*a, **k) + 1e-6)
    path = steps.prepare()
    assert path.name == "eager" and path.reason.startswith("the fast step differs from the eager one (max |Δ logit| ")
    assert path.reason.endswith("e-06, argmax same)")
    works = [__import__("gyrfalcon.engine.model.runner", fromlist=["Work"]).Work([5], 3, [0])]
    with torch.inference_mode():  # as the runner calls it
        assert steps.run(works) is None  # no bucket: the runner's own (unpadded) eager step serves


def test_a_batch_runs_compiled_only_where_it_fills_three_quarters_of_its_bucket(tiny_model_dir, monkeypatch):
    """With every bucket compiled (a stand-in compiler: the eager step itself, speed bar waived), 6
    rows run in the compiled batch-8 bucket and 5 rows eagerly, unpadded (None: the runner's step)."""
    from gyrfalcon.engine.model import captured
    from gyrfalcon.engine.model.runner import Work

    monkeypatch.setattr(captured, "COMPILED_MUST_TAKE", float("inf"))
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    steps = _steps(tiny_model_dir, max_batch=8)
    assert steps.prepare().name == "compiled" and set(steps._compiled_batches) == {1, 2, 4, 8}
    with torch.inference_mode():
        assert steps.run([Work([5], 3, [0])] * 5) is None
        assert steps.run([Work([5], 3, [0])] * 6).logits.shape[0] == 6
    assert steps.get(8, steps.width_buckets[0]).runs == 1


def test_a_bucket_that_fails_its_check_is_named_in_the_decode_path(tiny_model_dir, monkeypatch):
    """A stand-in compiler off in the last bits at batch 4 only: the other buckets serve compiled,
    batch 4 eagerly, and the path's reason (health, metrics, the bench's header) says why."""
    from gyrfalcon.engine.model import captured

    def off_at_four(fn, **_):
        return lambda ids, *a: fn(ids, *a) + (1e-6 if ids.shape[1] == 4 else 0.0)

    monkeypatch.setattr(captured, "COMPILED_MUST_TAKE", float("inf"))
    monkeypatch.setattr(torch, "compile", off_at_four)
    steps = _steps(tiny_model_dir, max_batch=8)
    path = steps.prepare()
    assert path.name == "compiled" and set(steps._compiled_batches) == {1, 2, 8}
    assert path.reason.startswith("batches 1, 2, 8; ")
    assert "; eager at batch 4: the fast step differs from the eager one (max |Δ logit| " in path.reason


def test_a_bucket_refused_once_is_not_compiled_again_at_the_next_start(tiny_model_dir, tmp_path, monkeypatch):
    """The verdict of a failed check is kept beside inductor's cache: the next start on the same
    machine, versions and model compiles every bucket but that one, and says why it runs eagerly;
    another model's start (another key) is not bound by it."""
    from gyrfalcon.engine.model import captured

    monkeypatch.setattr(captured, "COMPILED_MUST_TAKE", float("inf"))
    compiled_at: list[int] = []

    def off_at_four(fn, **_):
        def step(ids, *a):
            compiled_at.append(ids.shape[1])
            return fn(ids, *a) + (1e-6 if ids.shape[1] == 4 else 0.0)

        return step

    monkeypatch.setattr(torch, "compile", off_at_four)
    first = _steps(tiny_model_dir, max_batch=8, verdicts=tmp_path)
    assert set(first.prepare(background=False) and first._compiled_batches) == {1, 2, 8}
    assert [p.name for p in tmp_path.iterdir()] == [first.verdicts.path.name]

    compiled_at.clear()
    monkeypatch.setattr(torch, "compile", lambda fn, **_: lambda ids, *a: compiled_at.append(ids.shape[1]) or fn(ids, *a))
    again = _steps(tiny_model_dir, max_batch=8, verdicts=tmp_path)
    path = again.prepare()
    assert 4 not in compiled_at and set(again._compiled_batches) == {1, 2, 8}
    assert "eager at batch 4: the fast step differs from the eager one" in path.reason
    assert f"(at an earlier start; kept in {again.verdicts.path}: delete it to compile again)" in path.reason

    other = _steps(tiny_model_dir, max_batch=8, verdicts=tmp_path)
    other.verdicts = captured.Verdicts(tmp_path, "another-model")
    assert set(other.prepare() and other._compiled_batches) == {1, 2, 4, 8}


def test_check_fast_step_wants_the_same_argmax_and_logits_within_tolerance():
    logits = torch.tensor([[1.0, 2.0, 30.0]])
    assert check_fast_step(lambda: logits.clone(), lambda: logits) is None
    assert check_fast_step(lambda: logits + 2e-3, lambda: logits, rtol=1e-4) is None  # 30 * 1e-4 = 3e-3
    assert "max |Δ logit| 0.004, argmax same" in check_fast_step(lambda: logits + 4e-3, lambda: logits, rtol=1e-4)
    assert "argmax different" in check_fast_step(lambda: logits.flip(-1), lambda: logits)
    assert "shape (1, 2)" in check_fast_step(lambda: logits[:, :2], lambda: logits)
    assert check_fast_step(lambda: 1 / 0, lambda: logits).startswith("the fast step failed: ZeroDivisionError")


def test_a_bfloat16_kv_cache_holds_twice_the_tokens_and_keeps_rows_apart(tiny_model_dir):
    """--kv-cache-dtype bfloat16 beside an fp32 model: the same bytes hold twice the tokens, and a
    seeded request still gets the same tokens alone and inside a batch."""
    from gyrfalcon.plugins.engines import create_transformers_engine

    budget = 1 << 20
    full = create_transformers_engine(tiny_settings(tiny_model_dir, kv_cache_memory=budget))
    half = create_transformers_engine(tiny_settings(tiny_model_dir, kv_cache_memory=budget, kv_cache_dtype="bfloat16"))
    try:
        assert full.wait_ready(timeout=60).ready and half.wait_ready(timeout=60).ready
        assert half.core.runner.cache.keys[0].dtype == torch.bfloat16 and full.core.runner.cache.keys[0].dtype == torch.float32
        assert half.core.cache_plan.tokens >= 2 * full.core.cache_plan.tokens - half.core.cache_plan.block_size
        assert _ids(_alone(half)) == _ids(_together(half))
    finally:
        full.shutdown(1.0)
        half.shutdown(1.0)


class _StandInGraph:
    """A CUDA graph's stand-in on the CPU: its replay runs the captured step again, into the same
    buffers (what a replay does), ``off`` added to its logits."""

    def __init__(self, forward, into, off: float) -> None:
        self.forward, self.into, self.off = forward, into, off

    def replay(self) -> None:
        from gyrfalcon.engine.model.heads import heads_of

        heads_of(self.forward() + self.off, self.into)


def _stand_in_capture(captured: list[int], off_at: dict[int, float], raise_at: int | None = None):
    from gyrfalcon.engine.model.heads import heads_of

    def capture(forward, into, pool):
        logits = forward()
        batch = logits.shape[0]
        captured.append(batch)
        if batch == raise_at:
            raise RuntimeError("operation not permitted when stream is capturing")
        off = off_at.get(batch, 0.0)
        return _StandInGraph(forward, into, off), heads_of(logits + off, into), pool or ("stand-in pool",)

    return capture


def test_the_cuda_graph_path_serves_adapters_loaded_after_the_capture(stepped, tiny_model_dir, tmp_path, monkeypatch):
    """With ``--enable-lora`` the CUDA-graph branch (the stand-in capture: no GPU here) captures its
    buckets before any adapter is loaded, each bucket's rows computing every projection from its
    slots buffer; adapters loaded afterwards, mixed in one batch with the base model, get the eager
    engine's tokens."""
    from gyrfalcon.engine.model import graphs
    from tests.unit.test_batching import PROMPTS as SHORT, finals, run
    from tests.unit.test_lora import write_adapter

    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(graphs, "pool_bytes", lambda pool: 3 * 2**20)
    monkeypatch.setattr(graphs, "capture", _stand_in_capture([], {}))
    folders = {name: str(write_adapter(tiny_model_dir, tmp_path / name, seed=seed)) for name, seed in (("a", 1), ("b", 2))}
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    names = ["a", None, "b", "a"]

    def answers(engine):
        for name, folder in folders.items():
            engine.load_lora_adapter(name, folder)
        streams = [engine.submit(EngineRequest(f"r{i}", SHORT[i % len(SHORT)], greedy, lora_name=n))
                   for i, n in enumerate(names)]  # fmt: skip
        run(engine, streams)
        return finals(streams)

    expected = answers(stepped(enable_lora=True, max_loras=2))
    engine = stepped(enable_lora=True, max_loras=2)
    steps = engine.core.runner.decode_steps = DecodeSteps(engine.core.runner, 8, 128, mode="static")
    steps.mode, steps.pool_budget = "cuda-graphs", 2 * 2**20  # the graphs' branch, with the stand-in capture
    assert steps.prepare().name == "captured" and not engine.core.lora.held()
    assert all(bucket.step.lora.every_projection for bucket in steps._buckets.values())
    assert answers(engine) == expected and sum(b.runs for b in steps._buckets.values()) >= 5


def test_the_cuda_graph_path_captures_largest_first_checks_each_bucket_and_serves_the_engines_tokens(stepped, monkeypatch):
    """The CUDA-graph branch of the decode steps, on the CPU through a stand-in for the capture (no
    GPU here): every batch bucket captured at start-up, largest first, each checked against the
    eager step; the replays serve, the sampler takes the graphs' own argmax for greedy rows, and
    the tokens are the eager engine's. A bucket whose replay is off (by 1.0) or whose capture
    raises runs eagerly and the path names it; when every one fails, the path is eager with the
    first reason."""
    from gyrfalcon.engine.model import graphs
    from tests.unit.test_batching import PROMPTS as SHORT, finals, make_requests, request, run

    def greedy():
        return [request(SHORT[i], max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1) for i in range(3)]

    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(graphs, "pool_bytes", lambda pool: 3 * 2**20)

    def engine_on_graphs(capture):
        engine = stepped()
        steps = engine.core.runner.decode_steps = DecodeSteps(engine.core.runner, 8, 128, mode="static")
        steps.mode = "cuda-graphs"  # the graphs' branch, with the stand-in capture
        monkeypatch.setattr(graphs, "capture", capture)
        steps.pool_budget = 2 * 2**20
        return engine, steps, steps.prepare()

    plain = stepped()
    streams = [plain.submit(r) for r in make_requests()]
    run(plain, streams)
    expected = finals(streams)
    streams = [plain.submit(r) for r in greedy()]
    run(plain, streams)
    expected_greedy = finals(streams)

    captured: list[int] = []
    engine, steps, path = engine_on_graphs(_stand_in_capture(captured, {}))
    assert captured == [8, 4, 2, 1] and path.name == "captured"
    assert path.reason.startswith("4 buckets in ") and "pool 3 MiB, 2 measured beforehand" in path.reason
    sample, taken = engine.core.sampler.sample, []

    def watched(logits, rows, heads=None):
        result = sample(logits, rows, heads)
        taken.append(heads is not None and result.device_ids is heads.argmax)
        return result

    engine.core.sampler.sample = watched
    streams = [engine.submit(r) for r in make_requests()]
    run(engine, streams)
    assert finals(streams) == expected
    streams = [engine.submit(r) for r in greedy()]
    run(engine, streams)
    assert finals(streams) == expected_greedy
    assert sum(b.runs for b in steps._buckets.values()) > 10 and sum(taken) >= 5

    engine, steps, path = engine_on_graphs(_stand_in_capture([], {4: 1.0}, raise_at=2))
    assert path.name == "captured" and path.reason.startswith("eager for batch 4: the fast step differs")
    assert "; batch 2: the fast step failed: RuntimeError: operation not permitted" in path.reason
    assert [b.batch for b in steps._buckets.values() if b.graph is None] == [4, 2]
    streams = [engine.submit(r) for r in make_requests()]
    run(engine, streams)
    assert finals(streams) == expected

    _, _, path = engine_on_graphs(_stand_in_capture([], {8: 1.0, 4: 1.0, 2: 1.0, 1: 1.0}))
    assert path.name == "eager" and path.reason.startswith("batch 8: the fast step differs from the eager one")
