"""Requests whose constraints leave no token to generate: refused by the validator when that is certain,
else ended in-band with a 400 by the sampler (never a made-up token 0 or a NaN draw); the other
rows of the batch go on unchanged."""

from __future__ import annotations

import pytest

from gyrfalcon.api.errors import http_status
from gyrfalcon.errors import Kind, RequestError
from gyrfalcon.plugins import plugin_manager
from gyrfalcon.validation import RequestValidator
from tests.unit.test_batching import PROMPTS, alone, finals, request, run, stepped  # noqa: F401 - fixture

EOS = 2  # the tiny model's
B = 36  # "B" is one token; "BB" is [B, B]; " B" is two tokens (so bad_words bans B alone)


@pytest.mark.parametrize(
    "params",
    [
        dict(allowed_token_ids=[EOS], min_tokens=2),  # the review's repro: it generated [0, 0, 2]
        dict(allowed_token_ids=[EOS, 7], stop_token_ids=[7], min_tokens=1),
        dict(allowed_token_ids=[7], stop_token_ids=[7], ignore_eos=True, min_tokens=3),
    ],
)
def test_allowed_ids_all_banned_by_min_tokens_are_refused_before_submit(tiny_engine, params):
    with pytest.raises(RequestError) as err:
        RequestValidator.of(plugin_manager(), tiny_engine.info()).check(request(PROMPTS[0], max_tokens=4, temperature=0.0, **params))
    assert (err.value.type, err.value.param) == (Kind.INVALID, "allowed_token_ids")
    assert "min_tokens" in err.value.message


@pytest.mark.parametrize(
    "params",
    [
        dict(allowed_token_ids=[EOS], min_tokens=2, ignore_eos=True),  # eos is not banned then
        dict(allowed_token_ids=[EOS, 7], min_tokens=2),  # 7 remains
        dict(allowed_token_ids=[EOS]),  # no min_tokens: eos at once
    ],
)
def test_allowed_ids_with_a_token_left_are_accepted(tiny_engine, params):
    (last,) = list(tiny_engine.submit(request(PROMPTS[0], max_tokens=4, temperature=0.0, **params)))
    assert last.error is None and set(last.outputs[0].token_ids) <= set(params["allowed_token_ids"])


def _assert_excluded(item, tokens):
    assert item.finished and item.error is not None
    assert (http_status(item.error), item.error.type, item.error.param) == (400, "invalid_request_error", "allowed_token_ids")
    assert "every token is excluded by the request's constraints" in item.error.message
    assert "bad_words" in item.error.message
    assert [c.token_ids for c in item.outputs] == tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])  # argmax gave token 0; the sampled path NaN
def test_every_token_excluded_at_the_first_token_ends_in_band_and_spares_the_batch(stepped, temperature):
    engine = stepped()
    keep = dict(temperature=0.0, max_tokens=20, ignore_eos=True)
    (expected,) = alone(engine, [request(PROMPTS[0], **keep)])
    running = engine.submit(request(PROMPTS[0], **keep))
    for _ in range(3):
        engine.core.batcher.step()
    victim = engine.submit(request(PROMPTS[2], n=2, temperature=temperature, seed=1, max_tokens=5,
                                   allowed_token_ids=[B], bad_words=["B"]))  # fmt: skip
    engine.core.batcher.step()
    assert engine.core.batcher.running_sequences == 1 and victim.request_id not in engine.core._live
    (item,) = list(victim)
    _assert_excluded(item, [[], []])
    run(engine, [])
    assert finals([running]) == [expected]


def test_every_token_excluded_later_ends_in_band_with_the_tokens_so_far(stepped):
    """Decode path: "BB" bans B only after a B, so the first token is B and the second has none."""
    engine = stepped()
    keep = dict(temperature=0.7, seed=5, max_tokens=12, ignore_eos=True)
    (expected,) = alone(engine, [request(PROMPTS[1], **keep)])
    running = engine.submit(request(PROMPTS[1], **keep))
    victim = engine.submit(request(PROMPTS[3], temperature=0.0, max_tokens=5, allowed_token_ids=[B],
                                   bad_words=["BB"]))  # fmt: skip
    run(engine, [])
    (item,) = list(victim)
    _assert_excluded(item, [[B]])
    assert finals([running]) == [expected]
    assert engine.stats()["requests_failed"] == 1 and not engine.core._live
