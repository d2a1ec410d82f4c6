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
