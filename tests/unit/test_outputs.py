"""Output aggregation for n > 1 with children finishing at different steps: the client's choices
(text, stop strings) fed token by token as the core reports them (token-id stops from the core's
own stop checker), aggregated in each output kind."""

from __future__ import annotations

import pytest

from gyrfalcon.client.choice import IncrementalDetokenizer
from gyrfalcon.engine.request_state import StopChecker
from gyrfalcon.client.aggregator import OutputAggregator
from gyrfalcon.engine_api.types import (
    EngineError,
    EngineRequest,
    OutputKind,
    SamplingParams,
    TokenLogprobs,
)
from tests.unit.test_stopping import FedChoice

EOS = 2
PROMPT = [1, 87, 85, 264, 201]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


def make_state(tokenizer, kind: OutputKind, params: SamplingParams) -> OutputAggregator:
    request = EngineRequest("req-1", PROMPT, params, kind)
    specials = frozenset(tokenizer.all_special_ids)
    choices = [FedChoice(i, params, IncrementalDetokenizer(tokenizer, PROMPT, specials),
                         StopChecker(params, [EOS], len(PROMPT), 128)) for i in range(params.n)]  # fmt: skip
    return OutputAggregator(request, choices)


def scripts(tokenizer) -> list[list[int]]:
    """Choice 0 ends with eos at step 2, choice 2 on the stop string at step 3, choice 1 at length 4."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    return [enc("H") + [EOS], enc("Hello world, the"), enc("the capital of")]


def run(tokenizer, kind: OutputKind, n: int = 3):
    params = SamplingParams(n=n, max_tokens=4, stop=["capital"], temperature=0.7)
    state = make_state(tokenizer, kind, params)
    script = scripts(tokenizer)
    outputs, step = [], 0
    while not state.finished:
        for seq in state.sequences:
            if not seq.finished:
                seq.append(script[seq.index][step], TokenLogprobs([script[seq.index][step]], [-0.5], [[]], [[]]))
        step += 1
        out = state.make_output()
        if out is not None:
            outputs.append(out)
    return state, outputs


def test_final_only_is_one_output_with_every_choice_in_order(tokenizer):
    state, outputs = run(tokenizer, OutputKind.FINAL_ONLY)
    (final,) = outputs
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert [c.finish_reason for c in final.outputs] == ["stop", "length", "stop"]
    assert [c.stop_reason for c in final.outputs] == [None, None, "capital"]
    assert [c.text for c in final.outputs] == ["H", "Hello world", "the "]
    assert final.num_generated_tokens == sum(len(c.token_ids) for c in final.outputs) == 2 + 4 + 3
    assert final.prompt_token_ids == PROMPT
    assert [len(c.logprobs.token_ids) for c in final.outputs] == [2, 4, 3]
    assert state.make_output() is None


def test_delta_each_choice_ends_with_its_own_finish_and_joins_to_final(tokenizer):
    _, finals = run(tokenizer, OutputKind.FINAL_ONLY)
    _, deltas = run(tokenizer, OutputKind.DELTA)
    joined = {i: {"text": "", "tokens": [], "finishes": [], "after": 0, "logprobs": 0} for i in range(3)}
    for out in deltas:
        for choice in out.outputs:
            slot = joined[choice.index]
            if slot["finishes"]:
                slot["after"] += 1
            slot["text"] += choice.text
            slot["tokens"] += choice.token_ids
            slot["logprobs"] += len(choice.logprobs.token_ids)
            if choice.finish_reason:
                slot["finishes"].append(choice.finish_reason)
    for choice in finals[0].outputs:
        slot = joined[choice.index]
        assert slot["text"] == choice.text and slot["tokens"] == choice.token_ids
        assert slot["finishes"] == [choice.finish_reason] and slot["after"] == 0
        assert slot["logprobs"] == len(choice.token_ids)
    assert [out.finished for out in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].num_generated_tokens == 9
    # only changed choices: after step 2 choice 0 is never reported again
    assert all(0 not in [c.index for c in out.outputs] for out in deltas[2:])


def test_delta_finish_without_new_tokens_still_reported(tokenizer):
    params = SamplingParams(n=2, max_tokens=8)
    state = make_state(tokenizer, OutputKind.DELTA, params)
    ids = tokenizer.encode("one two", add_special_tokens=False)
    state.sequences[0].append(ids[0])
    state.sequences[1].append(ids[0])
    first = state.make_output()
    assert [c.index for c in first.outputs] == [0, 1]
    state.abort()
    last = state.make_output()
    assert last.finished
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in last.outputs] == [
        (0, "", [], "abort"),
        (1, "", [], "abort"),
    ]
    assert state.make_output() is None


def test_delta_holds_back_a_possible_stop_string(tokenizer):
    params = SamplingParams(n=1, max_tokens=8, stop=["lo wo"])
    state = make_state(tokenizer, OutputKind.DELTA, params)
    texts = []
    for token_id in tokenizer.encode("Hello world", add_special_tokens=False):
        state.sequences[0].append(token_id)
        out = state.make_output()
        texts.append([c.text for c in out.outputs])
    assert texts == [["H"], ["e"], ["l"], [""]]
    assert out.outputs[0].finish_reason == "stop" and out.finished


def test_cumulative_reports_every_choice_in_full(tokenizer):
    _, finals = run(tokenizer, OutputKind.FINAL_ONLY)
    _, outputs = run(tokenizer, OutputKind.CUMULATIVE)
    for out in outputs:
        assert [c.index for c in out.outputs] == [0, 1, 2]
    last = outputs[-1]
    assert [(c.text, c.token_ids, c.finish_reason) for c in last.outputs] == [
        (c.text, c.token_ids, c.finish_reason) for c in finals[0].outputs
    ]
    assert len(outputs[0].outputs[1].token_ids) == 1 and len(outputs[1].outputs[1].token_ids) == 2


def test_in_band_error_finishes_every_choice(tokenizer):
    state = make_state(tokenizer, OutputKind.DELTA, SamplingParams(n=2))
    out = state.fail(EngineError("boom"))
    assert out.finished and out.error.message == "boom"
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
