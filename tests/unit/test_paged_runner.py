"""Golden tests of the paged runner: logits over KV blocks equal the eager model's within 1e-5 (fp32)
for every family the loader serves, with prefill chunks and decode rows sharing forwards, block
tables that are not contiguous, and the static bucket-padded decode path."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from gyrfalcon.engine.kv.blocks import BlockPool
from gyrfalcon.engine.kv.cache import KVShape, PagedKVCache
from gyrfalcon.engine.model.runner import ModelRunner, Work

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip


def _config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if family == "llama":
        return LlamaConfig(**SMALL)
    if family == "qwen2":
        return Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    if family == "qwen3":
        return Qwen3Config(**SMALL, head_dim=16)
    if family == "mistral":
        return MistralConfig(**SMALL, sliding_window=8)
    raise ValueError(family)


def _models(family: str):
    """(reference model with sdpa attention, a copy for the paged runner), same weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _config(family)
    config._attn_implementation = "sdpa"
    reference = AutoModelForCausalLM.from_config(config).eval()
    paged = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    paged.load_state_dict(reference.state_dict())
    return reference, paged


class Seq:
    def __init__(self, tokens, pool):
        self.tokens, self.pool, self.blocks, self.computed = list(tokens), pool, [], 0

    def work(self, count, logits="last"):
        stop = self.computed + count
        while len(self.blocks) * self.pool.block_size < stop:
            self.blocks.append(self.pool.allocate())
        work = Work(self.tokens[self.computed : stop], self.computed, list(self.blocks), logits)
        self.computed = stop
        return work


def _reference(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


def _runner(model, blocks=64, block_size=4, capture="off", max_batch=8, attention="gather"):
    shape = KVShape.of(model.config, torch.float32)
    cache = PagedKVCache(shape, blocks, block_size, "cpu")
    pool = BlockPool(blocks, block_size)
    return ModelRunner(model, cache, capture=capture, max_batch=max_batch, max_model_len=256, attention=attention), pool


@pytest.mark.parametrize("attention", ["gather", "flex"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_chunked_prefill_and_decode_match_the_eager_model(family, attention):
    """Both attention backends: blocks copied then SDPA, and flex attention reading them in place."""
    reference, model = _models(family)
    runner, pool = _runner(model, attention=attention)
    assert runner.direct is not None and runner.model_impl.startswith("direct")  # the forward under test
    assert runner.attention == attention
    rng = random.Random(1)
    pool.allocate(), pool.allocate()  # so tables are not simply 1, 2, 3, …
    seqs = [Seq([rng.randrange(256) for _ in range(n)], pool) for n in (5, 19, 37)]
    a, b, c = seqs
    # step 1: a whole (every position's logits), b's first chunk; step 2: b's rest with c whole
    logits, spans = runner.forward([a.work(5, "all"), b.work(8, "none")])
    got_a = logits[spans[0][0] : spans[0][0] + 5]
    assert spans[1][1] == 0
    logits, spans = runner.forward([b.work(11), c.work(37, "all")])
    got_b, got_c = logits[spans[0][0]], logits[spans[1][0] : spans[1][0] + 37]
    torch.testing.assert_close(got_a, _reference(reference, a.tokens), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_b, _reference(reference, b.tokens)[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_c, _reference(reference, c.tokens), atol=1e-5, rtol=1e-5)
    # decode steps of all three (contexts cross the sliding window and block boundaries)
    for _ in range(6):
        for s in seqs:
            s.tokens.append(rng.randrange(256))
        logits, spans = runner.forward([s.work(1) for s in seqs])
        for s, (row, _) in zip(seqs, spans):
            torch.testing.assert_close(logits[row], _reference(reference, s.tokens)[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["gather", "flex"])
def test_static_bucket_padded_decode_equals_unpadded_decode(attention):
    """Flex attention reads the blocks in place: its step's shapes do not depend on the context, so
    its buckets have one width."""
    _, model = _models("mistral" if attention == "flex" else "llama")
    plain, pool = _runner(model)
    static = ModelRunner(model, plain.cache, capture="static", max_batch=8, max_model_len=256, attention=attention)
    width = 256 if attention == "flex" else 64
    rng = random.Random(2)
    seqs = [Seq([rng.randrange(256) for _ in range(n)], pool) for n in (3, 9, 14)]
    plain.forward([s.work(len(s.tokens)) for s in seqs])
    for _ in range(4):
        for s in seqs:
            s.tokens.append(rng.randrange(256))
        works = [s.work(1) for s in seqs]
        expected, _ = plain.forward(works)
        got, spans = static.forward(works)  # batch 3 runs in bucket 4: one padding row
        assert spans == [(0, 1), (1, 1), (2, 1)]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    bucket = static.decode_steps.get(4, width)
    assert bucket.runs == 4 and bucket.graph is None  # eager replay of the static buffers on the CPU
    steps = static.decode_steps
    assert steps.bucket(3, 20) == (4, width) and steps.bucket(9, 20) is None
    assert steps.bucket(5, 65) == (8, 256 if attention == "flex" else 128)


def test_a_step_sends_its_inputs_to_the_device_in_one_copy(monkeypatch):
    """Whatever the step holds — prefill chunks beside decode rows, a decode batch in a static
    bucket — its inputs (ids, positions, slots, block tables, kept rows) go in one upload."""
    from gyrfalcon.engine.model import staging

    _, model = _models("llama")
    plain, pool = _runner(model)
    static = ModelRunner(model, plain.cache, capture="static", max_batch=8, max_model_len=256)
    uploads = []
    real = staging.upload
    monkeypatch.setattr(staging, "upload", lambda values, device: uploads.append(len(values)) or real(values, device))
    seqs = [Seq([5 + n for n in range(length)], pool) for length in (3, 9, 14)]
    plain.forward([seqs[0].work(3), seqs[1].work(9, "all"), seqs[2].work(6, "none")])  # three prefills
    assert len(uploads) == 1
    for s in seqs[:2]:
        s.tokens.append(7)
    plain.forward([seqs[0].work(1), seqs[1].work(1), seqs[2].work(8)])  # two decode rows beside a prefill
    assert len(uploads) == 2
    seqs[2].tokens.append(7)
    for s in seqs:
        s.tokens.append(9)
    static.forward([s.work(1) for s in seqs])  # a decode batch in bucket 4
    # the bucket's inputs, its rows of the persistent block table, and the table's new entries (row,
    # column, block): work built by hand holds a row for one step, so every block of it is new
    assert len(uploads) == 3 and uploads[-1] == 4 * 4 + 4 + 3 * sum(len(s.blocks) for s in seqs)


def test_a_sequence_keeps_its_block_table_row_and_a_step_sends_only_its_new_blocks(monkeypatch):
    """Work that names its sequence (``owner``, with its own block list) keeps a row of the runner's
    persistent block table: a decode step whose sequences gained no block sends no table entry, one
    where a sequence gained a block sends that entry alone, and the logits are those of work built
    by hand (a row for one step, its table sent whole), plain and in a static bucket."""
    from gyrfalcon.engine.model import staging

    _, model = _models("llama")
    real = staging.upload
    for capture in ("off", "static"):
        kept, kept_pool = _runner(model, capture=capture)
        whole, whole_pool = _runner(model, capture=capture)
        owned = [Seq([5 + n for n in range(length)], kept_pool) for length in (3, 9, 14)]
        plain = [Seq([5 + n for n in range(length)], whole_pool) for length in (3, 9, 14)]
        uploads = []
        monkeypatch.setattr(staging, "upload", lambda values, device: uploads.append(len(values)) or real(values, device))

        def step(count: int | None = None) -> None:
            mine = []
            for seq in owned:
                work = seq.work(count or len(seq.tokens))
                mine.append(Work(work.tokens, work.start, seq.blocks, work.logits, owner=seq))
            got = kept.forward(mine)[0]
            assert torch.equal(got, whole.forward([seq.work(count or len(seq.tokens)) for seq in plain])[0]), capture
            for seq in (*owned, *plain):
                seq.tokens.append(int(got[0].argmax()))

        step()  # the prompts: 1, 3 and 4 blocks of 4 tokens
        step(1)  # 4, 10 and 15 tokens: no sequence gains a block
        step(1)  # 5, 11 and 16 tokens: the first gains its second block
        monkeypatch.undo()
        inputs = 4 * 4 + 4 if capture == "static" else 7 * 3  # a bucket of 4 rows, or the plain step's
        assert uploads[2::2] == [inputs, inputs + 3], (capture, uploads)  # (row, column, block) of one entry
        assert [len(seq.blocks) for seq in owned] == [2, 3, 4]
        for seq in owned:
            kept.block_table.release(seq)
        assert sorted(kept.block_table._free) == list(range(1, kept.block_table.tensor.shape[0]))


def _warm_up_steps(pool):
    scratch = [pool.SCRATCH]
    return [[Work([5, 6], 0, scratch, "all"), Work([7], 0, scratch)], [Work([5], 1, scratch), Work([6], 1, scratch)]]


def test_the_direct_forward_is_checked_against_transformers_and_dropped_where_it_differs():
    _, model = _models("qwen3")
    runner, pool = _runner(model)
    assert runner.check_direct(_warm_up_steps(pool)).startswith("direct") and runner.direct is not None
    real = runner.direct

    class Perturbed:
        def __call__(self, *args):
            return real(*args) + 0.01

    runner.direct = Perturbed()
    with pytest.raises(ValueError, match="--model-impl direct: the direct forward differs from the transformers one"):
        runner.check_direct(_warm_up_steps(pool), required=True)
    said = runner.check_direct(_warm_up_steps(pool))
    assert runner.direct is None and said.startswith("transformers (the direct forward differs from the transformers one")
    transformers_only = ModelRunner(model, runner.cache, model_impl="transformers")
    assert transformers_only.direct is None and transformers_only.model_impl == "transformers (--model-impl transformers)"
    runner.direct = real
    works = _warm_up_steps(pool)[0]
    torch.testing.assert_close(transformers_only.forward(works)[0], runner.forward(works)[0], atol=1e-5, rtol=1e-5)


def test_an_architecture_without_a_direct_forward_runs_transformers_and_direct_refuses_it():
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL, hidden_act="gelu")).eval()
    runner, _ = _runner(model)
    assert runner.direct is None and runner.model_impl == "transformers (hidden_act 'gelu' (the direct forward does silu))"
    with pytest.raises(ValueError, match="--model-impl direct: hidden_act 'gelu'"):
        ModelRunner(model, runner.cache, model_impl="direct")


def test_flex_attention_equals_gather_on_64_mixed_length_prompts():
    """64 prompts of 1 to 40 tokens prefilled in chunks beside each other, then decoded together:
    flex attention (the blocks read in place) gives the gather path's logits within 1e-5, and the
    same tokens when both decode greedily from them."""
    _, model = _models("qwen2")  # a sliding window on one layer
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(1, 41))] for _ in range(64)]
    logits_of = {}
    for attention in ("gather", "flex"):
        runner, pool = _runner(model, blocks=800, attention=attention)
        pool.allocate()  # tables start past block 1
        seqs = [Seq(p, pool) for p in prompts]
        rows = []
        for group in range(0, 64, 16):  # four prefill steps of 16 prompts, each prompt in up to two chunks
            batch = seqs[group : group + 16]
            firsts = [s.work(max(1, len(s.tokens) // 2), "none" if len(s.tokens) > 1 else "last") for s in batch]
            runner.forward(firsts)
            rest = [s for s in batch if s.computed < len(s.tokens)]
            logits, spans = runner.forward([s.work(len(s.tokens) - s.computed) for s in rest])
            rows.extend(logits[row] for row, _ in spans)
        steps = []
        for _ in range(4):  # greedy decode of all 64 together
            for s in seqs:
                s.tokens.append(int(s.tokens[-1] * 7 % 256))
            logits, _ = runner.forward([s.work(1) for s in seqs])
            steps.append(logits)
        logits_of[attention] = (torch.stack(rows), steps)
    gather_rows, gather_steps = logits_of["gather"]
    flex_rows, flex_steps = logits_of["flex"]
    torch.testing.assert_close(flex_rows, gather_rows, atol=1e-5, rtol=1e-5)
    for got, expected in zip(flex_steps, gather_steps):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_flex_attention_is_checked_against_gather_and_dropped_where_it_differs(monkeypatch):
    from gyrfalcon.engine.model import flex

    _, model = _models("llama")
    runner, pool = _runner(model, attention="flex")
    assert runner.check_attention(_warm_up_steps(pool)) == "flex (the KV blocks read in place)"
    real = flex.attend
    monkeypatch.setattr(flex, "attend", lambda *args: real(*args) + 0.05)
    with pytest.raises(ValueError, match="--attention-backend flex: the flex attention differs from the gather one"):
        runner.check_attention(_warm_up_steps(pool), required=True)
    said = runner.check_attention(_warm_up_steps(pool))
    assert runner.attention == "gather" and said.startswith("gather (the flex attention differs from the gather one")

    def broken(*args):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(flex, "attend", broken)
    runner, pool = _runner(model, attention="flex")
    said = runner.check_attention(_warm_up_steps(pool))
    assert runner.attention == "gather" and "RuntimeError: no kernel for this shape" in said, said
    assert _runner(model, attention="auto")[0].attention == "gather"  # auto on the CPU


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_decode_step_traces_whole_and_its_graph_equals_eager(family):
    """The static decode step (what is captured or compiled) traces into one graph with either
    attention, and that graph (run by dynamo's eager backend: no inductor compile here) gives the
    eager step's logits to the last bit: traced, the step takes the same shapes as eager (it did
    not while attention went through transformers' SDPA function, which packs a single query's
    heads only when not compiling)."""
    import torch._dynamo

    _, model = _models(family)
    for attention in ("gather", "flex"):
        runner, _ = _runner(model, capture="static", attention=attention)
        steps = runner.decode_steps
        bucket = steps.get(4, steps.width_buckets[0])
        steps._fill_synthetic(bucket)
        torch._dynamo.reset()
        with torch.inference_mode():
            explained = torch._dynamo.explain(runner.run_model)(bucket.ids, bucket.positions, bucket.step, 0)
            assert explained.graph_break_count == 0, (attention, explained.break_reasons)
            expected = steps._eager(bucket)
            bucket.step._masks.clear()
            traced = torch.compile(runner.run_model, backend="eager", fullgraph=True)
            got = traced(bucket.ids, bucket.positions, bucket.step, 0)
        assert torch.equal(got, expected), attention
    torch._dynamo.reset()


def test_the_direct_forward_looks_up_its_rotary_embeddings_own_values():
    """The direct forward looks cos/sin up by position (so a compiled step gets the eager step's
    bits: inductor computes them a last bit apart): each looked-up row is the model's rotary
    embedding's own value at that position, bit for bit. A rotary embedding whose frequencies
    depend on the batch (``dynamic``) runs as it is."""
    from transformers import LlamaConfig

    _, model = _models("llama")
    runner, _ = _runner(model)
    table = runner.direct.rotary
    assert table.cos is not None and table.cos.shape[0] == 256
    positions = torch.tensor([[0, 5, 3, 255, 17, 1]])
    hidden = torch.zeros(1, 6, model.config.hidden_size)
    want_cos, want_sin = model.model.rotary_emb(hidden, position_ids=positions)
    cos, sin = table(hidden, positions)
    assert torch.equal(cos[:, 0], want_cos[0]) and torch.equal(sin[:, 0], want_sin[0])

    from transformers import AutoModelForCausalLM

    config = LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    dynamic, _ = _runner(AutoModelForCausalLM.from_config(config).eval())
    assert dynamic.direct.rotary.cos is None
    cos, _ = dynamic.direct.rotary(hidden, positions)
    assert torch.equal(cos[:, 0], dynamic.model.model.rotary_emb(hidden, position_ids=positions)[0][0])


def test_a_prefills_one_row_groups_and_the_decode_rows_read_the_blocks_in_place(monkeypatch):
    """On the CPU a single-query row reads the blocks in place (``one_query_attention.c``, whose
    rows keep their bits alone and in any batch: ``tests/unit/test_native.py``), and so does a
    prefill's one-row group — a position just past a block boundary, which comes alone as a decode
    row when its prompt's first blocks are a prefix-cache hit — so that position's attention is the
    same kernel either way; the prefill's other groups keep SDPA. (The default model's test shows
    the whole row bit for bit: this tiny fp32 model's dense matmuls round by their row count.)"""
    from gyrfalcon.engine.model import one_query

    seen = []
    original = one_query.RowsInPlace.__call__

    def spy(self, q, blocks, positions):
        seen.append(positions.tolist())
        return original(self, q, blocks, positions)

    monkeypatch.setattr(one_query.RowsInPlace, "__call__", spy)
    _, model = _models("llama")
    runner, pool = _runner(model)  # blocks of 4 tokens
    assert runner.check_attention([]).endswith("one_query_attention.c)")
    prompt = list(range(3, 20))  # 17 tokens: groups 0-3, 4-7, 8-11, 12-15, then 16 alone
    whole, other = Seq(prompt, pool), Seq(list(range(30, 39)), pool)  # and 9: 0-3, 4-7, then 8
    runner.forward([whole.work(17), other.work(9)])
    assert seen == [[16], [8]] * model.config.num_hidden_layers
    seen.clear()
    whole.tokens.append(5), other.tokens.append(6)  # each one more token, decoded side by side
    runner.forward([other.work(1), whole.work(1)])
    assert seen == [[9, 17]] * model.config.num_hidden_layers


def test_a_block_table_row_given_to_another_sequence_holds_only_its_blocks():
    """A released row's next owner reads its own blocks and, past them, the scratch block (0), never
    the earlier owner's; an entry queued twice before it reached the device keeps its last value."""
    from gyrfalcon.engine.kv.table import BlockTable

    table = BlockTable(max_blocks=6, device="cpu", rows=2)
    first, second = object(), object()
    long_blocks = [7, 8, 9, 10]
    row = table.place(first, long_blocks)
    table.apply(torch.tensor(table.take_pending()))
    assert table.tensor[row].tolist() == [7, 8, 9, 10, 0, 0]
    table.release(first)
    assert table.place(second, [3]) == row  # the same row, taken again
    table.apply(torch.tensor(table.take_pending()))
    assert table.tensor[row].tolist() == [3, 0, 0, 0, 0, 0]
    grown = [3]
    table.place(second, grown)
    grown.append(4)  # a step that did not reach the device, then the row reused: duplicates resolve to the last
    table.place(second, grown)
    table.release(second)
    third = object()
    table.place(third, [5, 6])
    table.apply(torch.tensor(table.take_pending()))
    assert table.tensor[row].tolist() == [5, 6, 0, 0, 0, 0]
    rows = [table.place(object(), [1]) for _ in range(3)]  # more owners than rows: the table grows
    assert len(set(rows)) == 3 and 0 not in rows and table.tensor.shape[0] >= 4


def test_block_table_entries_whose_copy_failed_go_out_with_the_next_step(monkeypatch):
    """A step's copy to the device raises after its new block entries were taken: they are queued
    again, ahead of the next step's, and reach the table with it."""
    from gyrfalcon.engine.kv.table import BlockTable
    from gyrfalcon.engine.model import staging

    table = BlockTable(max_blocks=4, device="cpu", rows=2)
    owner, blocks = object(), [7, 8]
    row = table.place(owner, blocks)
    upload = staging.upload

    def failing(values, device):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(staging, "upload", failing)
    with pytest.raises(RuntimeError, match="copy failed"):
        staging.send_step([[row]], table, None, torch.device("cpu"))
    monkeypatch.setattr(staging, "upload", upload)
    blocks.append(9)
    (sent,) = staging.send_step([[table.place(owner, blocks)]], table, None, torch.device("cpu"))
    assert sent.tolist() == [row] and table.tensor[row].tolist() == [7, 8, 9, 0]


@pytest.mark.parametrize("attention", ["gather", "flex"])
def test_the_step_budget_is_measured_on_a_provisional_cache_before_the_real_one_is_sized(monkeypatch, attention):
    """On CUDA the KV cache is sized after measuring what steps take beside it: the largest eager
    step (max_num_batched_tokens in prompt chunks, each the last of a full-length prompt, the first
    keeping every position's logits) and the largest start-up decode bucket's step (what capturing
    it takes from the graphs' pool; the static buffers stand in for the graphs here), both on a
    provisional cache of one full-length sequence's blocks, and flex attention's masks per block of
    the cache. The runner then serves from the real cache with the logits of a runner made on it,
    and the plan leaves the measured bytes out of the --gpu-memory-utilization budget (the
    device's figures stand in: no GPU here)."""
    from gyrfalcon.engine.kv.cache import plan_cache
    from gyrfalcon.engine.model import budget, flex

    _, model = _models("mistral" if attention == "flex" else "llama")
    shape = KVShape.of(model.config, torch.float32)
    provisional = PagedKVCache(shape, budget.provisional_blocks(256, 4), 4, "cpu")
    runner = ModelRunner(model, provisional, capture="static", max_batch=8, max_model_len=256, attention=attention)
    steps = runner.decode_steps
    steps.mode = "cuda-graphs"  # measured as the graphs would be; nothing is captured here
    measured: list[tuple[int, bool, bool]] = []

    def peak(fn):  # what ran: the runner's forwards, whether the heads buffers were there, what it wrote
        forwards, outputs = runner.forwards, steps._outputs is not None
        caches = [runner.cache.keys[0].clone(), runner.cache.keys[0]]
        fn()
        written = (caches[0] != caches[1]).any(dim=(1, 2)).nonzero().flatten()
        measured.append((runner.forwards - forwards, outputs, bool(written.numel()) and int(written.max()) < 4))
        return 1000 * len(measured)

    works = budget.prefill_works(40, 16, 256, 4)
    assert [(len(w.tokens), w.start, w.logits) for w in works] == [(16, 240, "all"), (16, 240, "last"), (8, 248, "last")]
    reserve = budget.measure_reserve(runner, max_tokens=40, chunk=16, max_model_len=256, peak=peak)
    assert measured == [(1, False, True), (0, True, True)]  # the scratch block's slots only; the buffers made before
    outputs = runner.decode_steps.outputs
    assert reserve.total == 3000 and reserve.outputs == outputs.logits.numel() * 4 * 2 + 8 * (8 + 4 + 4)
    assert reserve.per_block == (flex.mask_bytes_per_block(3, 16) + flex.mask_bytes_per_block(8, 1)
                                 if attention == "flex" else 0)  # fmt: skip
    assert runner.decode_steps.made == 0 and runner.decode_steps.pool_budget == 2000
    real, pool = PagedKVCache(shape, 64, 4, "cpu"), BlockPool(64, 4)
    runner.use_cache(real)
    runner.decode_steps.mode = "static"
    fresh, fresh_pool = _runner(model, capture="static", attention=attention)
    seqs = [Seq([5, 9, 14, 2, 7, 11], pool), Seq([5, 9, 14, 2, 7, 11], fresh_pool)]
    assert torch.equal(runner.forward([seqs[0].work(5)])[0], fresh.forward([seqs[1].work(5)])[0])
    assert torch.equal(runner.forward([seqs[0].work(1)])[0], fresh.forward([seqs[1].work(1)])[0])  # a bucket
    with pytest.raises(ValueError, match="same shape"):
        runner.use_cache(PagedKVCache(shape, 64, 8, "cpu"))
    with pytest.raises(ValueError, match="once decode buckets are made"):
        runner.use_cache(PagedKVCache(shape, 64, 4, "cpu"))

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * gib)
    big = KVShape(num_layers=24, num_kv_heads=32, head_dim=64, dtype=torch.bfloat16)
    per_block = big.bytes_per_token * 16
    plain = plan_cache(big, "cuda:0", 16, 4096, 8192, gpu_memory_utilization=0.5)
    kept = plan_cache(big, "cuda:0", 16, 4096, 8192, gpu_memory_utilization=0.5, reserve_bytes=3 * gib,
                      reserve_per_block=2048)  # fmt: skip
    assert plain.num_blocks == (40 - 10) * gib // per_block
    assert kept.num_blocks == (40 - 10 - 3) * gib // (per_block + 2048) and "3072 MiB set aside for steps" in kept.reason


def test_flex_attentions_masks_keep_the_bytes_the_budget_counts_per_block():
    """The bytes a block mask keeps grow with the cache's blocks by flex.mask_bytes_per_block: its
    block indices and each row's logical index of every block (what the cache's sizing counts)."""
    from gyrfalcon.engine.model import flex

    def kept(num_blocks: int, rows: int, queries: int) -> int:
        cache = PagedKVCache(KVShape(1, 1, 16, torch.float32), num_blocks, 16, "cpu")
        mask = flex.block_mask(cache, torch.zeros(rows, 4, dtype=torch.long), torch.full((rows,), 40), queries, None)
        tensors = [getattr(mask, name, None) for name in dir(mask)]
        tensors += [cell.cell_contents for cell in mask.mask_mod.__closure__ or ()]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    for rows, queries in ((8, 1), (3, 512)):
        assert kept(300, rows, queries) - kept(100, rows, queries) == 200 * flex.mask_bytes_per_block(rows, queries)


def test_the_cpus_default_cache_holds_one_context_shared_by_the_running_sequences(monkeypatch):
    """On the CPU, without --kv-cache-memory: --max-num-seqs full-length sequences, but at most one
    context of the model's length or 8,192 tokens, whichever is more (llama-server's -c), then at
    most 2 GiB and a quarter of the memory available."""
    from gyrfalcon.engine.kv import cache

    monkeypatch.setattr(cache, "_available_cpu_bytes", lambda: 64 << 30)
    shape = KVShape(30, 3, 64, torch.bfloat16)  # the default model's, in the CPU's default dtype: 23,040 B a token
    default = cache.plan_cache(shape, "cpu", 16, 16, 8192)
    assert default.tokens == 8192 and default.num_blocks == 8192 // 16 + 1 and "one context of 8192 tokens" in default.reason
    assert cache.plan_cache(shape, "cpu", 16, 4, 1024).tokens == 4 * 1024  # four full sequences fit in 8,192
    assert cache.plan_cache(shape, "cpu", 16, 16, 1024).tokens == 8192
    assert cache.plan_cache(shape, "cpu", 16, 16, 32768).tokens == 32768  # the model's longer context
    assert cache.plan_cache(shape, "cpu", 16, 16, 8192, kv_cache_memory=1 << 30).bytes <= 1 << 30
    monkeypatch.setattr(cache, "_available_cpu_bytes", lambda: 400 << 20)  # a quarter: 100 MiB
    assert cache.plan_cache(shape, "cpu", 16, 16, 8192).bytes <= 100 << 20
