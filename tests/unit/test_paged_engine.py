"""The engine over KV blocks: children share their prompt's blocks, a burst that overflows the
cache preempts and recomputes with the same tokens, prefix-cache hits are counted."""

from __future__ import annotations

import random

import pytest

from tests.unit.test_batching import finals, request, run, stepped  # noqa: F401 - fixture

_rng = random.Random(11)
LONG = [[1] + [_rng.randrange(3, 512) for _ in range(29)] for _ in range(6)]
BLOCK_BYTES = 16 * 512  # tiny model: 2 layers x (K + V) x 2 KV heads x 16 dims x 4 bytes = 512 B per token


def test_n_children_share_the_prompts_full_blocks_and_copy_the_partial_one(stepped):
    engine = stepped()
    pool = engine.core.scheduler.pool
    free = pool.num_free
    prompt = [1] + [_rng.randrange(3, 512) for _ in range(39)]  # 40 tokens: 2 full blocks + 8
    stream = engine.submit(request(prompt, n=4, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))
    engine.core.batcher.step()  # one prefill, four first tokens, fork
    (state,) = engine.core.scheduler.running
    tables = [seq.blocks for seq in state.sequences]
    assert all(table[:2] == tables[0][:2] for table in tables)  # shared, not copied
    assert len({table[2] for table in tables}) == 4  # the partial block: one copy per child
    assert [pool.refs[b] for b in tables[0][:2]] == [4, 4]
    assert free - pool.num_free == 2 + 4
    run(engine, [stream])
    (choices,) = finals([stream])
    assert [len(c) for c in choices] == [6] * 4
    assert pool.num_free == free


def test_a_burst_that_overflows_the_blocks_preempts_and_every_request_gets_its_alone_tokens(stepped, tiny_model_dir):
    roomy = stepped()
    # penalties too: a preempted sequence rejoins the persistent batch with its generated-token counts
    asks = [dict(temperature=1.0, seed=i, top_k=50) if i % 2 else dict(temperature=0.0) for i in range(6)]
    for ask in asks[::3]:
        ask.update(frequency_penalty=0.7, repetition_penalty=1.3)
    make = lambda: [request(p, max_tokens=20, ignore_eos=True, **a) for p, a in zip(LONG, asks)]  # noqa: E731
    expected = []
    for req in make():
        streams = [roomy.submit(req)]
        run(roomy, streams)
        expected.extend(finals(streams))
    tight = stepped(kv_cache_memory=12 * BLOCK_BYTES, enable_prefix_caching=False)  # 11 usable blocks
    assert tight.core.scheduler.pool.usable_blocks == 11  # each request needs 4 blocks at its end
    streams = [tight.submit(r) for r in make()]
    run(tight, streams)
    assert finals(streams) == expected
    stats = tight.stats()
    assert stats["preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert len(tight.core.batcher.batch) == 0  # every slot given back


def test_prefix_cache_hits_skip_the_shared_prompt_and_are_counted(stepped):
    engine = stepped()
    prompt = LONG[0] + LONG[1]  # 60 tokens: 3 full blocks before the last token
    first = [engine.submit(request(prompt, temperature=0.0, max_tokens=4, ignore_eos=True))]
    run(engine, first)
    before = engine.stats()
    again = [engine.submit(request(prompt, temperature=0.0, max_tokens=4, ignore_eos=True))]
    run(engine, again)
    after = engine.stats()
    assert finals(again) == finals(first)
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 3
    assert after["prompt_tokens"] - before["prompt_tokens"] == 60 - 48


def test_the_static_decode_path_gives_the_engines_tokens(stepped):
    """The path CUDA graphs replay (static buffers, bucket padding), run eagerly through the whole
    engine: the same tokens as plain steps, alone and batched."""
    from gyrfalcon.engine.model.captured import DecodeSteps
    from tests.unit.test_batching import make_requests

    plain = stepped()
    expected = []
    for req in make_requests():
        streams = [plain.submit(req)]
        run(plain, streams)
        expected.extend(finals(streams))
    static = stepped()
    static.core.runner.decode_steps = DecodeSteps(static.core.runner, 8, 128, mode="static")
    streams = [static.submit(r) for r in make_requests()]
    run(static, streams)
    assert finals(streams) == expected
    assert sum(b.runs for b in static.core.runner.decode_steps._buckets.values()) > 10


def test_a_steps_own_reductions_serve_the_rows_no_processor_touches(stepped):
    """The static path computes what a captured graph does: the logits' argmax, largest values,
    log-softmax and the argmax's logprob with the logits (engine/model/heads.py). A step whose
    rows are all greedy and unprocessed takes them (its tokens are the step's own argmax); a step
    with a penalised or sampled row computes its own. Either way every request gets, bit for bit,
    the tokens and log-probabilities of the same steps sampled without them, and the eager
    engine's tokens (the tiny model is fp32, whose padded batches round apart in the last bits)."""
    from gyrfalcon.engine.model.captured import DecodeSteps

    def outputs(streams):
        finished = [list(stream)[-1] for stream in streams]
        return [[(c.token_ids, c.logprobs.logprobs, c.logprobs.top_token_ids, c.logprobs.top_logprobs)
                 for c in f.outputs] for f in finished]  # fmt: skip

    def served(asks, with_heads: bool, path: str = "static"):
        engine = stepped()
        if path == "static":
            engine.core.runner.decode_steps = DecodeSteps(engine.core.runner, 8, 128, mode="static")
        sample, taken = engine.core.sampler.sample, []

        def watched(logits, rows, heads=None):
            result = sample(logits, rows, heads if with_heads else None)
            taken.append(heads is not None and heads.reduced and result.device_ids is heads.argmax)
            return result

        engine.core.sampler.sample = watched
        streams = [engine.submit(request(LONG[i][:10], max_tokens=8, ignore_eos=True, **a)) for i, a in enumerate(asks)]
        run(engine, streams)
        return outputs(streams), taken

    greedy = [dict(temperature=0.0, logprobs=2), dict(temperature=0.0, logprobs=0, logprob_token_ids=[5, 9]),
              dict(temperature=0.0, logprobs=1)]  # fmt: skip
    mixed = [*greedy[:2], dict(temperature=0.0, logprobs=1, frequency_penalty=0.5),
             dict(temperature=0.9, seed=3, logprobs=1)]  # fmt: skip
    for asks in (greedy, mixed):
        got, taken = served(asks, with_heads=True)
        without, _ = served(asks, with_heads=False)
        eager, _ = served(asks, with_heads=True, path="eager")
        assert got == without
        assert [[c[0] for c in r] for r in got] == [[c[0] for c in r] for r in eager]
        assert sum(taken) >= 6 if asks is greedy else not any(taken)


def test_an_engine_that_measures_its_steps_before_sizing_its_cache_serves_the_same_tokens(stepped, monkeypatch, caplog):
    """CUDA's start-up order, run on the CPU with a stand-in probe (no GPU here): the runner is made
    on a provisional cache, its largest step measured, then it moves to the real cache; requests
    get the tokens of an engine that measured nothing, and the log says what was set aside."""
    from gyrfalcon.engine import setup
    from tests.unit.test_batching import make_requests

    plain = stepped()
    streams = [plain.submit(r) for r in make_requests()]
    run(plain, streams)
    expected = finals(streams)
    measured = []

    def probe(fn):
        fn()
        measured.append(fn)
        return 3 * 2**20

    monkeypatch.setattr(setup, "step_probe", lambda device: probe)
    engine = stepped()
    assert len(measured) == 1 and "3 MiB set aside for steps (workspace 3" in caplog.text
    assert engine.core.runner.cache.num_blocks == plain.core.runner.cache.num_blocks > 1
    streams = [engine.submit(r) for r in make_requests()]
    run(engine, streams)
    assert finals(streams) == expected


def test_penalised_and_plain_rows_share_steps_at_any_slot(stepped):
    """Generated-token counts are kept for every slot a step draws for, not only the penalised ones."""
    engine = stepped(max_num_seqs=16, max_queue_len=16)
    asks = [dict(max_tokens=6, frequency_penalty=0.5, ignore_eos=True, temperature=0.0),
            dict(n=8, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)]  # fmt: skip
    expected = []
    for prompt, ask in zip(LONG, asks):
        streams = [engine.submit(request(prompt, **ask))]
        run(engine, streams)
        expected.extend(finals(streams))
    streams = [engine.submit(request(prompt, **ask)) for prompt, ask in zip(LONG, asks)]
    run(engine, streams)
    assert finals(streams) == expected
    assert len(engine.core.batcher.batch) == 0


def test_n_beyond_max_num_seqs_decodes_its_choices_in_turns(stepped):
    """n is capped by max_request_seqs, not by the running batch: the choices beyond max_num_seqs
    wait their turn, and every choice gets the tokens it gets in a batch wide enough for all."""
    ask = dict(n=10, temperature=1.0, seed=77, max_tokens=5, ignore_eos=True)
    wide = stepped(max_num_seqs=16)
    streams = [wide.submit(request(LONG[2], **ask))]
    run(wide, streams)
    expected = finals(streams)
    narrow = stepped(max_num_seqs=4)
    forward = narrow.core.runner.step
    decode_rows = []

    def counting(works):
        if all(len(w.tokens) == 1 for w in works):
            decode_rows.append(len(works))
        return forward(works)

    narrow.core.runner.step = counting
    streams = [narrow.submit(request(LONG[2], **ask))]
    run(narrow, streams)
    got = finals(streams)
    assert got == expected and len(got[0]) == 10
    assert decode_rows and max(decode_rows) == 4
    assert len(narrow.core.batcher.batch) == 0


def _counter(copies: dict[str, int]):
    """``counted(function, direction)``: ``function``, counting its calls in ``copies[direction]``."""

    def counted(function, direction):
        def wrapper(*args, **kwargs):
            copies[direction] += 1
            return function(*args, **kwargs)

        return wrapper

    return counted


@pytest.mark.parametrize("path", ["eager", "static"])
def test_a_decode_step_makes_one_copy_to_the_device_and_one_back(stepped, monkeypatch, path):
    """The step's inputs, its rows' slots and draw positions, the rows of each policy that only
    some rows want (greedy and sampled rows, top-k, top-p, a penalty, logprobs on one row) and the
    ids min_tokens bans go to the device in one copy; the sampled ids, the rows' largest logits and
    the logprobs come back in one."""
    import torch

    from gyrfalcon.policies import base as policies
    from gyrfalcon.engine.model import staging
    from gyrfalcon.engine.model.captured import DecodeSteps
    from gyrfalcon.engine.sample import persistent_batch, sampler
    from gyrfalcon.policies import logprobs, penalties

    engine = stepped()
    if path == "static":
        engine.core.runner.decode_steps = DecodeSteps(engine.core.runner, 8, 128, mode="static")
    asks = [dict(temperature=0.0, min_tokens=12, stop_token_ids=[7, 9]), dict(temperature=0.8, seed=1, top_k=20),
            dict(temperature=0.0, logprobs=2), dict(temperature=1.0, seed=2, top_p=0.9, frequency_penalty=0.5)]  # fmt: skip
    streams = [engine.submit(request(LONG[i][:12], max_tokens=12, ignore_eos=True, **a)) for i, a in enumerate(asks)]
    for _ in range(3):  # the prompts' prefills and the first tokens
        engine.core.batcher.step()
    assert all(len(state.sequences[0].token_ids) >= 1 for state in engine.core.scheduler.running)
    copies = {"to the device": 0, "to the host": 0}
    counted = _counter(copies)

    monkeypatch.setattr(staging, "upload", counted(staging.upload, "to the device"))
    for module in (policies, persistent_batch, sampler, penalties, logprobs):
        monkeypatch.setattr(module, "to_device", counted(policies.to_device, "to the device"))
    monkeypatch.setattr(torch.Tensor, "tolist", counted(torch.Tensor.tolist, "to the host"))
    forwards = engine.core.runner.forwards
    for _ in range(4):
        assert engine.core.batcher.step()
    monkeypatch.undo()
    assert engine.core.runner.forwards - forwards == 4 and engine.core.batcher.running_sequences == 4
    assert copies == {"to the device": 4, "to the host": 4}
    if path == "static":
        assert sum(b.runs for b in engine.core.runner.decode_steps._buckets.values()) >= 4
    run(engine, streams)
    assert [len(c[0]) for c in finals(streams)] == [12] * 4


def test_a_step_with_a_prefill_and_a_first_draw_of_n_choices_makes_one_copy_each_way(stepped, monkeypatch):
    """A decoding request beside a newcomer's whole prompt, whose first token is drawn for its three
    choices from the prompt's last row: the rows drawn (not every row of the step's logits, in
    order) go to the device with the step's inputs, in its one copy; the tokens are those of the
    requests alone."""
    import torch

    from gyrfalcon.policies import base as policies
    from gyrfalcon.engine import batcher
    from gyrfalcon.engine.model import staging

    asks = [dict(temperature=0.0, max_tokens=8, ignore_eos=True),
            dict(n=3, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True)]  # fmt: skip
    engine = stepped()
    expected = []
    for prompt, ask in zip(LONG, asks):
        streams = [engine.submit(request(prompt[:12], **ask))]
        run(engine, streams)
        expected.extend(finals(streams))
    streams = [engine.submit(request(LONG[0][:12], **asks[0]))]
    for _ in range(2):
        engine.core.batcher.step()
    streams.append(engine.submit(request(LONG[1][:12], **asks[1])))
    copies = {"to the device": 0, "to the host": 0}
    counted = _counter(copies)

    indexes = []
    draw_index = batcher.Batcher._draw_index

    def watched(rows, staged, carried, device):
        index = draw_index(rows, staged, carried, device)
        sent = staged.rider.tensor.untyped_storage().data_ptr()
        indexes.append((list(rows), index.clone(), index.untyped_storage().data_ptr() == sent))
        return index

    monkeypatch.setattr(batcher.Batcher, "_draw_index", staticmethod(watched))
    monkeypatch.setattr(staging, "upload", counted(staging.upload, "to the device"))
    monkeypatch.setattr(batcher, "to_device", counted(policies.to_device, "to the device"))
    monkeypatch.setattr(torch.Tensor, "tolist", counted(torch.Tensor.tolist, "to the host"))
    engine.core.batcher.step()  # the decode row and the newcomer's prefill: 1 + 3 draws from 2 rows
    monkeypatch.undo()
    assert copies == {"to the device": 1, "to the host": 1}
    ((rows, index, in_the_copy),) = indexes
    assert rows == index.tolist() == [0, 1, 1, 1] and in_the_copy  # a view of the step's one copy
    assert engine.core.batcher.running_sequences == 4
    run(engine, streams)
    assert finals(streams) == expected


def test_with_overlap_a_steps_outputs_go_out_once_the_next_forward_is_launched(stepped):
    """On a GPU a step's outputs are sent after the next step's forward is launched (the host's work
    overlaps the device's): one step later than at once, in one emit per step, the last ones when
    the loop finds nothing left to run, and the same tokens as sending at once."""
    import queue

    from gyrfalcon.engine_api.types import OutputKind
    from tests.unit.test_batching import make_requests

    plain = stepped()
    streams = [plain.submit(r) for r in make_requests()]
    run(plain, streams)
    expected = finals(streams)

    late = stepped()
    late.core.batcher.overlap = True
    emits = []
    emit = late.core.batcher.emit
    late.core.batcher.emit = lambda states: (emits.append(len(states)), emit(states))
    stream = late.submit(request(LONG[0][:10], kind=OutputKind.DELTA, max_tokens=3, ignore_eos=True))
    seen = []

    def drain():
        try:
            while (item := stream.get(timeout=0)) is not None:
                seen.append(item)
        except queue.Empty:
            pass

    for step in range(1, 4):  # a prefill with the first token, then two decode steps
        assert late.core.batcher.step()
        drain()
        assert sum(len(item.outputs[0].token_ids) for item in seen) == step - 1, (step, seen)
    assert not late.core.batcher.step()  # nothing left to run: the last output goes out
    drain()
    assert seen[-1].finished and sum(len(item.outputs[0].token_ids) for item in seen) == 3
    assert stream.get(timeout=0) is None  # the stream ended
    assert emits == [1, 1, 1]
    streams = [late.submit(r) for r in make_requests()]
    run(late, streams)
    assert finals(streams) == expected
