"""``cache_salt``: requests share cached prompt blocks only with requests of the same salt."""

from __future__ import annotations

import random


def _hits(engine) -> int:
    return engine.stats()["prefix_cache_hits"]


def test_cache_salt_isolates_prefix_cache_hits(client, tiny_engine):
    rng = random.Random(8)
    prompt = [1] + [rng.randrange(3, 500) for _ in range(40)]  # two full blocks before the last token
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}

    def complete(**extra):
        r = client.simulate_post("/v1/completions", json={**body, **extra})
        assert r.status_code == 200, r.text
        return r.json["choices"][0]["text"]

    first = complete(cache_salt="tenant-a")
    before = _hits(tiny_engine)
    assert complete(cache_salt="tenant-b") == first  # another salt: computed anew, same answer
    assert _hits(tiny_engine) == before
    assert complete(cache_salt="tenant-a") == first  # the same salt: its blocks are found
    assert _hits(tiny_engine) == before + 2


def test_cache_salt_must_not_be_empty(client):
    r = client.simulate_post("/v1/completions", json={"model": "tiny", "prompt": "hi", "cache_salt": ""})
    assert r.status_code == 400 and r.json["error"]["param"] == "cache_salt"


def test_every_prompt_of_a_request_is_read_as_it_runs_so_its_stop_strings_end_it_early(client, tiny_engine):
    """Several prompts in one non-streaming request: each prompt's text is checked for stop strings
    while it runs, not after the earlier prompts finished, so the core stops it early. Here prompt 0
    runs its 40 tokens and prompt 1 hits its stop string after a few."""
    rng = random.Random(9)
    body = {"model": "tiny", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    for _ in range(20):  # two prompts where prompt 1's early text does not occur in prompt 0's
        prompts = [[1] + [rng.randrange(3, 500) for _ in range(6)] for _ in range(2)]
        full = client.simulate_post("/v1/completions", json={**body, "prompt": prompts}).json["choices"]
        stop = tiny_engine.detokenize(full[1]["token_ids"][3:5])
        if stop.strip() and stop not in full[0]["text"]:
            break
    before = tiny_engine.stats()["generation_tokens"]
    r = client.simulate_post("/v1/completions", json={**body, "prompt": prompts, "stop": [stop]})
    assert r.status_code == 200, r.text
    first, second = r.json["choices"]
    assert (first["finish_reason"], len(first["token_ids"])) == ("length", 40)
    assert second["finish_reason"] == "stop" and len(second["token_ids"]) < 10
    # read one after the other, prompt 1 would have run to 40 tokens too
    assert tiny_engine.stats()["generation_tokens"] - before <= 40 + len(second["token_ids"]) + 3
