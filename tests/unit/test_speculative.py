"""Speculative decoding (``--speculative-config``, n-gram): proposals from the sequence's own
n-grams, and an engine that speculates computing exactly what one that does not computes —
greedy, seeded, with penalties and logprobs, ``n`` > 1 — or not speculating where it could not."""

from __future__ import annotations

import pytest

from gyrfalcon.config import Settings
from gyrfalcon.engine.spec import verify
from gyrfalcon.engine.spec.ngram import NgramIndex
from gyrfalcon.engine_api.config import SpeculativeConfig
from gyrfalcon.engine_api.types import EngineRequest, SamplingParams
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.conftest import tiny_settings

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


def test_the_trailing_ngram_proposes_what_followed_its_latest_earlier_occurrence():
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 4, 5, 1, 2, 3])
    assert index.propose(3) == [4, 5, 1]  # [1, 2, 3] seen before, then 4, 5, 1
    index.extend([9])
    assert index.propose(3) == []  # 9 never came before
    index.extend([1, 2])
    assert index.propose(2) == [3, 9]  # the latest [1, 2] was followed by 3, 9 (longest match: [9, 1, 2])
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


@pytest.mark.parametrize(("text", "why"), [
    ('{"method": "draft_model", "model": "x", "num_speculative_tokens": 3}', "draft_model is not built yet"),
    ('{"method": "ngram"}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "must not exceed"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}', "not a field"),
    ("ngram", "must be a JSON object")])  # fmt: skip
def test_a_config_it_cannot_serve_is_refused_at_start_up(tiny_model_dir, text, why):
    with pytest.raises(ValueError, match=why):
        Settings(model=tiny_model_dir, speculative_config=text).validate()
    assert SpeculativeConfig.parse(NGRAM).num_speculative_tokens == 4


def _requests() -> list[EngineRequest]:
    """Prompts that repeat themselves (drafts to take), greedy and seeded with ``n`` = 2, with a
    penalty, a grammar (its matcher must see each turn's token) and logprobs."""
    greedy = dict(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    return [EngineRequest("loop", [5, 6, 7, 8] * 4, SamplingParams(**greedy)),
            EngineRequest("pairs", [9, 10, 11] * 3, SamplingParams(**{**greedy, "repetition_penalty": 1.2})),
            EngineRequest("seeded", [20, 21, 22, 5, 6, 7, 8] * 2, SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=30,
                                                                             ignore_eos=True, logprobs=0)),
            EngineRequest("constrained", [30, 31, 32], SamplingParams(**{**greedy, "structured_outputs": {
                "regex": "(ab|cd)( (ab|cd)){30}"}}))]  # fmt: skip


def _served(model_dir: str, speculative: str | None, quantization: str) -> tuple[list, dict, str]:
    """Every choice's tokens and logprobs, the engine's stats and what its health says of speculation."""
    engine = create_transformers_engine(tiny_settings(model_dir, max_model_len=256, speculative_config=speculative,
                                                      quantization=quantization))  # fmt: skip
    try:
        assert engine.wait_ready(60).ready
        streams = [engine.submit(request) for request in _requests()]
        finals = [list(stream)[-1] for stream in streams]
        outputs = [(c.token_ids, c.logprobs.logprobs, c.logprobs.top_token_ids, c.logprobs.top_logprobs)
                   for final in finals for c in final.outputs]  # fmt: skip
        return outputs, engine.core.stats(), engine.health().speculative
    finally:
        engine.shutdown(0)


def test_int4_layers_speculate_to_the_same_bits_as_plain_decoding(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(verify, "MAX_SEQUENCES", 5)  # every step of these five sequences speculates (default: one alone)
    plain, _, _ = _served(tiny_model_dir, None, "int4")
    speculated, stats, health = _served(tiny_model_dir, NGRAM, "int4")
    assert stats["spec_decode_num_accepted_tokens"] > 10, stats  # it did speculate, and kept drafts
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]  # and rejected some
    assert health.startswith("ngram (up to 4 draft tokens")
    assert speculated == plain


def test_layers_whose_rows_differ_beside_others_do_not_speculate(tiny_model_dir):
    # (no answers compared: these layers' answers depend on what runs beside them, speculation or not)
    _, stats, health = _served(tiny_model_dir, NGRAM, "none")
    assert health.startswith("off (a decode row's logits differ beside other rows")
    assert "spec_decode_num_drafts" not in stats


def test_health_and_metrics_say_what_speculates(tiny_model_dir):
    from tests.helpers import api_client, served_app

    settings = tiny_settings(tiny_model_dir, max_model_len=256, speculative_config=NGRAM, quantization="int4",
                             served_model_name=["tiny"])  # fmt: skip
    engine = create_transformers_engine(settings)
    try:
        assert engine.wait_ready(60).ready
        client = api_client(served_app(engine, settings))
        body = {"model": "tiny", "prompt": [5, 6, 7, 8] * 4, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        assert client.simulate_post("/v1/completions", json=body).status_code == 200
        assert client.simulate_get("/health").json["speculative"].startswith("ngram (")
        metrics = client.simulate_get("/metrics").text
        drafts = [line for line in metrics.splitlines() if line.startswith("gyrfalcon:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0, metrics
        assert 'gyrfalcon:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"}' in metrics
    finally:
        engine.shutdown(0)
