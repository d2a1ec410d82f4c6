"""Speculative decoding (``--speculative-config``, n-gram): proposals from the sequence's own
n-grams, and an engine that speculates computing exactly what one that does not computes —
greedy, seeded, with penalties and logprobs, ``n`` > 1 — or not speculating where it could not."""

from __future__ import annotations

import json

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
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "needs model"),
    ('{"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "prompt_lookup_min": 1}', "not a field"),
    ('{"method": "eagle", "model": "x", "num_speculative_tokens": 3}', "not served"),
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


def _served(model_dir: str, speculative: str | None, quantization: str, **overrides) -> tuple[list, dict, str]:
    """Every choice's tokens and logprobs, the engine's stats and what its health says of speculation."""
    engine = create_transformers_engine(tiny_settings(model_dir, max_model_len=256, speculative_config=speculative,
                                                      quantization=quantization, **overrides))  # fmt: skip
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


def _finals(model_dir: str, speculative: str | None, requests: list[EngineRequest], **overrides) -> tuple[list, dict]:
    """Every choice's (tokens, finish reason, stop reason) and the engine's stats."""
    engine = create_transformers_engine(tiny_settings(model_dir, max_model_len=256, speculative_config=speculative,
                                                      quantization="int4", **overrides))  # fmt: skip
    try:
        assert engine.wait_ready(60).ready
        streams = [engine.submit(request) for request in requests]
        finals = [list(stream)[-1] for stream in streams]
        return [(c.token_ids, c.finish_reason, c.stop_reason) for f in finals for c in f.outputs], engine.core.stats()
    finally:
        engine.shutdown(0)


def test_stop_tokens_max_tokens_and_preemption_land_where_plain_decoding_puts_them(tiny_model_dir, monkeypatch):
    """A draft that runs past a stop token or ``max_tokens`` is cut where plain decoding stops, and a
    sequence preempted while it speculates is recomputed to the same tokens."""
    monkeypatch.setattr(verify, "MAX_SEQUENCES", 6)
    greedy = dict(temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [40, 41, 42, 43, 44] * 3]
    free_run, _ = _finals(tiny_model_dir, None, [EngineRequest(f"p{i}", p, SamplingParams(max_tokens=40, **greedy))
                                                 for i, p in enumerate(prompts)])  # fmt: skip
    # stop on the 11th token each sequence makes (a repeated one is the stop only at its first time)
    cut = [EngineRequest(f"s{i}", p, SamplingParams(max_tokens=40, stop_token_ids=[tokens[10]], **greedy))
           for i, (p, (tokens, _, _)) in enumerate(zip(prompts, free_run))]  # fmt: skip
    cut += [EngineRequest(f"m{i}", p, SamplingParams(max_tokens=13 + i, **greedy)) for i, p in enumerate(prompts)]
    plain, _ = _finals(tiny_model_dir, None, cut)
    assert [(reason, len(tokens) <= 11) for tokens, reason, _ in plain[:3]] == [("stop", True)] * 3
    assert [len(tokens) for tokens, _, _ in plain[3:]] == [13, 14, 15]
    speculated, stats = _finals(tiny_model_dir, NGRAM, cut)
    assert stats["spec_decode_num_accepted_tokens"] > 4, stats
    assert speculated == plain
    # 8 usable blocks of 16 tokens (fp16 KV: 256 bytes a token): six sequences of 2 blocks cannot all stay
    tight, stats = _finals(tiny_model_dir, NGRAM, cut, kv_cache_memory=9 * 16 * 256, enable_prefix_caching=False)
    assert stats["preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert tight == plain


def test_sampled_first_tokens_are_distributed_as_without_speculation(tiny_model_dir, monkeypatch):
    """A chi-squared test of homogeneity on the first four sampled tokens of 200 requests with
    speculation and 200 without, on seeds the two runs do not share: what the target distribution
    is must not change (the seeded runs are bit-equal besides, tested above). Unequal biases towards
    the prompt's four tokens and top-k 4 leave few outcomes, unequally likely, and drafts from the
    prompt are often taken."""
    import torch

    monkeypatch.setattr(verify, "MAX_SEQUENCES", 256)
    prompt = [5, 6, 7, 8] * 4
    ask = dict(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True, logit_bias={5: 8.0, 6: 7.0, 7: 6.0, 8: 5.0})
    counts = []
    for speculative, first_seed in ((None, 0), (NGRAM, 10_000)):
        requests = [EngineRequest(f"r{i}", prompt, SamplingParams(seed=first_seed + i, **ask)) for i in range(200)]
        outputs, stats = _finals(tiny_model_dir, speculative, requests, max_num_seqs=256, max_queue_len=256)
        if speculative:
            assert stats["spec_decode_num_accepted_tokens"] > 50, stats
        counted: dict[tuple[int, int], int] = {}
        for tokens, _, _ in outputs:
            for position, token in enumerate(tokens):
                counted[(position, token)] = counted.get((position, token), 0) + 1
        counts.append(counted)
    plain, speculated = counts
    cells = sorted(set(plain) | set(speculated))
    table = torch.tensor([[plain.get(c, 0) for c in cells], [speculated.get(c, 0) for c in cells]], dtype=torch.float64)
    # cells expected below 5 pooled into one, as a chi-squared test wants
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    small = expected.min(0).values < 5
    table = torch.cat([table[:, ~small], table[:, small].sum(1, keepdim=True)], dim=1) if small.any() else table
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))
    assert dof >= 4, table  # outcomes enough to test
    assert p_value > 0.001, (statistic, dof, table)
    print(f"chi-squared {statistic:.2f}, {dof} degrees of freedom, p = {p_value:.3f}")


def _draft_config(folder) -> str:
    return json.dumps({"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3})


def test_a_draft_model_speculates_to_the_same_bits_and_a_foreign_tokenizer_is_refused(tiny_model_dir, tmp_path,
                                                                                      monkeypatch):  # fmt: skip
    """A draft model's greedy tokens are verified as n-gram drafts are: the served model's own tokens
    and logprobs, whatever the draft (the served model itself, whose greedy drafts are kept, or
    another random model, whose are mostly not); a draft whose tokenizer differs fails the load."""
    from gyrfalcon.models.tiny import build_tiny_model

    monkeypatch.setattr(verify, "MAX_SEQUENCES", 5)
    plain, _, _ = _served(tiny_model_dir, None, "int4")
    itself, stats, health = _served(tiny_model_dir, _draft_config(tiny_model_dir), "int4")
    assert health.startswith("draft_model (up to 3 draft tokens from ")
    assert itself == plain
    kept = stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"]
    other = build_tiny_model(tmp_path / "other", seed=7)
    foreign, stats, _ = _served(tiny_model_dir, _draft_config(other), "int4")
    assert foreign == plain
    foreign_kept = stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"]
    # the served model's fp32 weights draft for its int4 ones, and sampled, penalised and constrained
    # rows take a greedy draft less often: a quarter kept here, against under 1 % of a random model's
    assert kept > 0.15 and foreign_kept < kept / 4, (kept, foreign_kept)
    wider = build_tiny_model(tmp_path / "wider", vocab_size=600)
    engine = create_transformers_engine(tiny_settings(tiny_model_dir, speculative_config=_draft_config(wider),
                                                      quantization="int4"))  # fmt: skip
    try:
        health = engine.wait_ready(60)
        assert not health.ready and "the draft model's tokenizer is not the served model's" in health.message
    finally:
        engine.shutdown(0)
