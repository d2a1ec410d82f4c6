"""Golden test of the cache surgery: forked and filtered rows equal the per-request reference."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.engine.runner import ModelRunner

PROMPT = [1, 87, 85, 264, 201, 42, 302]


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    from gyrfalcon.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(tiny_model_dir, "float32", "cpu")
    return ModelRunner(model, "cpu")


def reference(runner, ids):
    with torch.inference_mode():
        return runner.model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def test_prefill_fork_select_match_reference(runner):
    logits, batch = runner.prefill(PROMPT)
    torch.testing.assert_close(logits[0], reference(runner, PROMPT), atol=1e-5, rtol=0)
    batch.fork(3)
    assert batch.rows == 3 and batch.lengths.tolist() == [7, 7, 7]
    firsts = [10, 20, 30]
    logits = runner.decode(batch, firsts)
    for row, token in enumerate(firsts):
        torch.testing.assert_close(logits[row], reference(runner, PROMPT + [token]), atol=1e-5, rtol=0)
    batch.select([2, 0])  # row 1 finished; order may change
    logits = runner.decode(batch, [31, 11])
    torch.testing.assert_close(logits[0], reference(runner, PROMPT + [30, 31]), atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1], reference(runner, PROMPT + [10, 11]), atol=1e-5, rtol=0)
    assert batch.lengths.tolist() == [9, 9] and batch.width == 9


def test_masks_and_positions_come_from_lengths(runner):
    _, batch = runner.prefill(PROMPT[:5])
    batch.fork(2)
    batch.lengths = torch.tensor([3, 5])  # pretend row 0 is left-padded by two columns
    assert batch.attention_mask(1).tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert batch.position_ids(1).tolist() == [[3], [5]]
    keys = batch.cache.layers[0].keys.clone()
    batch.select([0])  # the padding no remaining row needs is dropped
    assert batch.width == 3 and batch.attention_mask(1).tolist() == [[1, 1, 1, 1]]
    torch.testing.assert_close(batch.cache.layers[0].keys, keys[:1, :, 2:, :])


def assert_rows(logits, histories, runner):
    for row, ids in enumerate(histories):
        torch.testing.assert_close(logits[row], reference(runner, ids), atol=1e-5, rtol=0)


def test_merge_of_different_lengths_matches_reference(runner):
    long_prompt = PROMPT + [44, 45, 46, 47]  # 11 tokens
    short = [1, 90, 91]
    logits_a, running = runner.prefill(short)
    running.fork(2)
    logits = runner.decode(running, [5, 6])
    histories = [short + [5], short + [6]]
    assert_rows(logits, histories, runner)
    # a wider newcomer: the running rows are left-padded
    logits_b, newcomer = runner.prefill(long_prompt)
    torch.testing.assert_close(logits_b[0], reference(runner, long_prompt), atol=1e-5, rtol=0)
    running.merge(newcomer)
    histories.append(long_prompt)
    assert running.rows == 3 and running.lengths.tolist() == [4, 4, 11] and running.width == 11
    logits = running_step(runner, running, histories, [7, 8, 9])
    # a narrower newcomer: it is left-padded
    _, tiny = runner.prefill([1, 2])
    running.merge(tiny)
    histories.append([1, 2])
    logits = running_step(runner, running, histories, [10, 11, 12, 13])
    # filter the widest row away: columns no one needs are dropped
    running.select([0, 1, 3])
    histories = [histories[0], histories[1], histories[3]]
    assert running.width == int(running.lengths.max())
    running_step(runner, running, histories, [14, 15, 16])
    # empty, then a newcomer becomes the whole batch
    running.select([])
    assert running.rows == 0 and running.width == 0
    _, fresh = runner.prefill(short)
    running.merge(fresh)
    running_step(runner, running, [list(short)], [17])


def running_step(runner, batch, histories, tokens):
    logits = runner.decode(batch, tokens)
    for ids, token in zip(histories, tokens):
        ids.append(token)
    assert_rows(logits, histories, runner)
    return logits


def test_chunked_and_grouped_prefill_match_reference(runner):
    prompt = PROMPT + [60, 61, 62, 63, 64]  # 12 tokens in chunks of 5, 5, 2
    batch = runner.new_batch(1)
    for start in range(0, len(prompt), 5):
        logits = runner.forward(batch, [prompt[start : start + 5]])
    torch.testing.assert_close(logits[0], reference(runner, prompt), atol=1e-5, rtol=0)
    other = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    group = runner.new_batch(2)
    everything = runner.forward(group, [prompt, other], all_logits=True)
    assert everything.shape[:2] == (2, 12)
    for t in (3, 11):
        torch.testing.assert_close(everything[1, t], reference(runner, other[: t + 1]), atol=1e-5, rtol=0)
    group.select([0, 1, 1])  # fork the second prompt into two children
    batch.merge(group)
    running_step(runner, batch, [list(prompt), list(prompt), list(other), list(other)], [20, 21, 22, 23])


@pytest.mark.parametrize("fail_at", [1, 2, 4])  # first layer keys or values, last layer values
def test_a_merge_that_raises_leaves_the_running_batch_as_it_was(runner, monkeypatch, fail_at):
    """An OOM part-way through merge() must not leave some layers merged: the running requests
    go on (the batcher fails only the newcomers)."""
    from gyrfalcon.engine import kv_cache

    short = [1, 90, 91]
    _, running = runner.prefill(short)
    running.fork(2)
    runner.decode(running, [5, 6])
    histories = [short + [5], short + [6]]
    before = [(layer.keys.clone(), layer.values.clone()) for layer in running._layers()]
    _, newcomer = runner.prefill(PROMPT)  # wider: the running rows would be padded
    pad_left, calls = kv_cache._pad_left, {"n": 0}

    def flaky(tensor, columns):
        calls["n"] += 1
        if calls["n"] == fail_at * 2:  # the newcomer's side of the fail_at-th concatenation
            raise RuntimeError("out of memory (simulated)")
        return pad_left(tensor, columns)

    monkeypatch.setattr(kv_cache, "_pad_left", flaky)
    with pytest.raises(RuntimeError, match="out of memory"):
        running.merge(newcomer)
    monkeypatch.setattr(kv_cache, "_pad_left", pad_left)
    assert running.rows == 2 and running.lengths.tolist() == [4, 4] and running.width == 4
    for layer, (keys, values) in zip(running._layers(), before):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    running_step(runner, running, histories, [7, 8])
