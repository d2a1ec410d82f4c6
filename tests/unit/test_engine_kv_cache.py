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
