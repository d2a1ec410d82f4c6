"""Slow readers get coalesced deltas: the per-request queue stays bounded and the totals are exact."""

from __future__ import annotations

import queue

import pytest

from gyrfalcon.engine_api.streams import CoalescingOutputStream, merge_deltas
from gyrfalcon.engine_api.types import CompletionOutput, OutputKind, RequestOutput, TokenLogprobs
from tests.unit.test_batching import PROMPTS, alone, request, run, stepped  # noqa: F401 - fixture


def delta(*choices, finished=False, tokens=0):
    return RequestOutput("r", list(choices), finished=finished, num_generated_tokens=tokens)


def test_merge_deltas_concatenates_per_choice():
    a = delta(CompletionOutput(0, "he", [1], TokenLogprobs([1], [-0.1], [[]], [[]])), CompletionOutput(1, "x", [7]), tokens=2)
    b = delta(CompletionOutput(1, "y", [8], finish_reason="stop", stop_reason=8),
              CompletionOutput(0, "llo", [2], TokenLogprobs([2], [-0.2], [[]], [[]])), finished=False, tokens=4)  # fmt: skip
    merged = merge_deltas(a, b)
    assert [c.index for c in merged.outputs] == [0, 1]
    zero, one = merged.outputs
    assert (zero.text, zero.token_ids, zero.logprobs.logprobs, zero.finish_reason) == ("hello", [1, 2], [-0.1, -0.2], None)
    assert (one.text, one.token_ids, one.finish_reason, one.stop_reason) == ("xy", [7, 8], "stop", 8)
    assert merged.num_generated_tokens == 4


def test_stream_keeps_at_most_one_unread_item():
    stream = CoalescingOutputStream("r", OutputKind.DELTA)
    for i in range(50):
        stream.put(delta(CompletionOutput(0, str(i % 10), [i]), tokens=i + 1))
    stream.put(delta(CompletionOutput(0, "!", [99], finish_reason="length"), finished=True, tokens=51))
    stream.finish()
    assert stream.pending() == 2 and stream.coalesced == 50
    (item,) = list(stream)
    assert item.finished and item.outputs[0].token_ids == [*range(50), 99] and item.outputs[0].finish_reason == "length"
    with pytest.raises(StopIteration):
        next(stream)


def test_cumulative_replaces_and_get_times_out():
    stream = CoalescingOutputStream("r", OutputKind.CUMULATIVE)
    with pytest.raises(queue.Empty):
        stream.get(timeout=0.01)
    stream.put(delta(CompletionOutput(0, "a", [1])))
    stream.put(delta(CompletionOutput(0, "ab", [1, 2])))
    assert stream.get(timeout=0.01).outputs[0].text == "ab"
    stream.finish()
    assert stream.get() is None


def test_engine_lagging_reader_gets_the_same_text(stepped):
    engine = stepped()
    params = dict(n=2, temperature=1.0, seed=9, max_tokens=30, ignore_eos=True)
    (expected,) = alone(engine, [request(PROMPTS[1], **params)])
    stream = engine.submit(request(PROMPTS[1], kind=OutputKind.DELTA, **params))
    run(engine, [])  # nobody reads while the request runs
    assert stream.core_stream.pending() <= 2 and stream.core_stream.coalesced > 0  # the core's deltas merged
    tokens: dict[int, list[int]] = {0: [], 1: []}
    for item in stream:
        for choice in item.outputs:
            tokens[choice.index] += choice.token_ids
    assert [tokens[0], tokens[1]] == expected
