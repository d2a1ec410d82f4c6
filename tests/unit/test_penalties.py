"""Penalty, bias, allow-list and bad-words processors: batch results equal a per-row reference."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gyrfalcon.engine.sample import persistent_batch
from gyrfalcon.engine_api.types import EngineInfo, EngineRequest, SamplingParams
from gyrfalcon.errors import Kind, RequestError
from gyrfalcon.validation import RequestValidator
from gyrfalcon.policies import penalties as P
from gyrfalcon.policies import BatchRows

V = 40
INFO = EngineInfo("tiny", V, 128, [2], 20, 8, frozenset())


def rows_of(*specs) -> list[tuple]:
    """specs: (params, prompt ids, output ids)."""
    return list(specs)


def apply(processor, logits, specs):
    """Run ``processor`` on rows joined to a persistent batch, as the engine does."""
    rows: BatchRows = persistent_batch.rows_for([processor], V, [s[0] for s in specs], [s[1] for s in specs],
                                                [list(s[2]) for s in specs])  # fmt: skip
    selected = rows.selected.get(id(processor), [])
    assert selected == [i for i, s in enumerate(specs) if processor.wants(s[0], {})]
    return processor(logits.clone(), rows, selected), selected


def reference_penalties(logits, params, prompt, output):
    """vLLM's order: repetition (prompt + output), then frequency and presence (output only)."""
    out = logits.clone()
    seen = set(prompt) | set(output)
    for t in range(V):
        if t in seen and params.repetition_penalty != 1.0:
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
        count = output.count(t)
        out[t] -= params.frequency_penalty * count
        if count:
            out[t] -= params.presence_penalty
    return out


SPECS = [
    (SamplingParams(repetition_penalty=1.3), [1, 5, 5, 9], [3, 3, 7]),
    (SamplingParams(), [4, 4], [4]),  # nothing asked: untouched
    (SamplingParams(frequency_penalty=0.5, presence_penalty=-0.7), [8], [8, 2, 2, 2, 11]),
    (SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.5), [0, 39], [39, 39, 6]),
    (SamplingParams(presence_penalty=2.0), [12, 13], []),
]


def test_penalties_match_the_per_row_reference():
    torch.manual_seed(0)
    logits = torch.randn(len(SPECS), V) * 3
    rows = rows_of(*SPECS)
    out = logits.clone()
    for processor in sorted([P.RepetitionPenaltyProcessor(), P.FrequencyPenaltyProcessor(), P.PresencePenaltyProcessor()],
                            key=lambda p: p.order):  # fmt: skip
        out, _ = apply(processor, out, rows)
    for i, (params, prompt, output) in enumerate(SPECS):
        torch.testing.assert_close(out[i], reference_penalties(logits[i], params, prompt, output), atol=1e-6, rtol=0)


def test_logit_bias_and_allowed_token_ids():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    rows = rows_of(
        (SamplingParams(logit_bias={3: 5.0, 7: -250.0}, allowed_token_ids=[3, 7, 9]), [1], []),
        (SamplingParams(), [1], []),
        (SamplingParams(logit_bias={0: 0.25}), [1], []),
    )
    biased, selected = apply(P.LogitBiasProcessor(), logits, rows)
    assert selected == [0, 2]
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 7] -= 100.0  # clamped
    expected[2, 0] += 0.25
    torch.testing.assert_close(biased, expected)
    allowed, selected = apply(P.AllowedTokenIdsProcessor(), logits, rows)
    assert selected == [0]
    assert [t for t in range(V) if math.isfinite(allowed[0, t])] == [3, 7, 9]
    torch.testing.assert_close(allowed[1:], logits[1:])


class FakeTokenizer:
    """Words are split into letters; a leading space makes its own token (id 30) glued to the letter."""

    def encode(self, text, add_special_tokens=False):
        ids = []
        for i, ch in enumerate(text):
            if ch == " ":
                continue
            spaced = i > 0 and text[i - 1] == " "
            ids.append(ord(ch) - ord("a") + (14 if spaced and i == 1 else 1))
        return ids


def test_blank_bad_words_ban_their_own_tokens(tiny_engine):
    """A word of white space only (the spec allows it) is honoured: its tokens are never generated."""
    from tests.unit.test_engine import PROMPT, final

    space = tiny_engine.tokenize(" ", add_special_tokens=False)
    assert len(space) == 1
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = final(tiny_engine, bad_words=[" "], logit_bias={space[0]: 100.0}, **greedy).outputs[0]
    assert space[0] not in out.token_ids


def test_bad_words_follow_vllm():
    processor = P.BadWordsProcessor("unused", tokenizer=FakeTokenizer())
    # "ab" → (1, 2) and " ab" → (14, 2); "c" → (3,) and " c" → (16,)
    assert processor.token_sequences(("ab", " c")) == ((1, 2), (14, 2), (3,), (16,))
    torch.manual_seed(2)
    logits = torch.randn(3, V)
    rows = rows_of(
        (SamplingParams(bad_words=["ab", " c"]), [1], [5, 1]),  # generated ends with "a": ban "b"
        (SamplingParams(bad_words=["ab"]), [1], [1, 5]),  # does not end with a prefix
        (SamplingParams(), [1], [1]),
    )
    out, _ = apply(processor, logits, rows)
    banned = {(i, t) for i in range(3) for t in range(V) if not math.isfinite(out[i, t])}
    assert banned == {(0, 2), (0, 3), (0, 16)}
    torch.testing.assert_close(out[1:], logits[1:])


@pytest.mark.parametrize(
    ("processor", "params", "param"),
    [
        (P.PresencePenaltyProcessor(), SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (P.FrequencyPenaltyProcessor(), SamplingParams(frequency_penalty=math.nan), "frequency_penalty"),
        (P.RepetitionPenaltyProcessor(), SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (P.RepetitionPenaltyProcessor(), SamplingParams(repetition_penalty=2.01), "repetition_penalty"),
        (P.RepetitionPenaltyProcessor(), SamplingParams(repetition_penalty=1e-300), "repetition_penalty"),
        (P.RepetitionPenaltyProcessor(), SamplingParams(repetition_penalty=0.0099), "repetition_penalty"),
        (P.AllowedTokenIdsProcessor(), SamplingParams(allowed_token_ids=[2], min_tokens=1), "allowed_token_ids"),
        (P.LogitBiasProcessor(), SamplingParams(logit_bias={V: 1.0}), "logit_bias"),
        (P.LogitBiasProcessor(), SamplingParams(logit_bias={1: math.inf}), "logit_bias"),
        (P.AllowedTokenIdsProcessor(), SamplingParams(allowed_token_ids=[]), "allowed_token_ids"),
        (P.AllowedTokenIdsProcessor(), SamplingParams(allowed_token_ids=[1, -1]), "allowed_token_ids"),
        (P.BadWordsProcessor("unused", FakeTokenizer()), SamplingParams(bad_words=["ok", ""]), "bad_words.1"),
    ],
)
def test_validation_names_the_param(processor, params, param):
    assert refusal(params, processor).param == param


def refusal(params: SamplingParams, processor) -> RequestError:
    """The validator's refusal of an engine request built without the API, served with ``processor``:
    the bounds the documents and the deployment give, then the processor's own rules."""
    info = dataclasses.replace(INFO, capabilities=INFO.capabilities | params.asked_fields())
    with pytest.raises(RequestError) as err:
        RequestValidator(info, [processor]).check(EngineRequest("r", [1], params))
    assert err.value.type == Kind.INVALID
    return err.value


def test_engine_honours_the_fields(tiny_engine):
    from tests.unit.test_engine import PROMPT, final

    info = tiny_engine.info()
    assert {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids",
            "bad_words"} <= info.capabilities  # fmt: skip
    greedy = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert final(tiny_engine, logit_bias={77: 100.0}, **greedy).outputs[0].token_ids == [77] * 8
    out = final(tiny_engine, allowed_token_ids=[40, 41, 42], n=2, temperature=1.0, max_tokens=8, seed=1)
    assert all(set(c.token_ids) <= {40, 41, 42} for c in out.outputs)
    plain = final(tiny_engine, **greedy).outputs[0].token_ids
    repeated = final(tiny_engine, frequency_penalty=2.0, repetition_penalty=2.0, **greedy).outputs[0].token_ids
    assert len(set(repeated)) >= len(set(plain))
    # a single-token word is banned everywhere
    token = next(t for t in plain if tiny_engine.tokenize(tiny_engine.detokenize([t]).lstrip()) == [t])
    banned = final(tiny_engine, bad_words=[tiny_engine.detokenize([token])], **greedy).outputs[0]
    assert token not in banned.token_ids and banned.token_ids[: plain.index(token)] == plain[: plain.index(token)]


def test_repetition_penalty_minimum_agrees_with_the_spec():
    params = SamplingParams(repetition_penalty=0.01)
    info = dataclasses.replace(INFO, capabilities=INFO.capabilities | params.asked_fields())
    RequestValidator(info, [P.RepetitionPenaltyProcessor()]).check(EngineRequest("r", [1], params))
    assert "[0.01, 2]" in str(refusal(SamplingParams(repetition_penalty=0.005), P.RepetitionPenaltyProcessor()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("penalty", [0.01, 1e-300, 0.0])  # the last two only if validation is bypassed
def test_repetition_penalty_never_makes_inf_or_nan(dtype, penalty):
    """1e-300 became 0.0 in fp32 and divided positive logits into inf (then NaN downstream)."""
    logits = torch.tensor([[30000.0, 5.0, -3.0, -math.inf, 1.0] + [0.0] * (V - 5)], dtype=dtype)
    params = SamplingParams(repetition_penalty=penalty)
    out, _ = apply(P.RepetitionPenaltyProcessor(), logits, rows_of((params, [0, 1, 2, 3], [])))
    assert out.dtype == dtype
    assert torch.isfinite(out[0, [0, 1, 2, 4]]).all() and out[0, 3] == -math.inf  # a masked token stays masked
    assert out[0, 1] > 5.0 and -3.0 < out[0, 2] <= 0 and out[0, 4] == 1.0  # a penalty < 1 favours seen tokens
