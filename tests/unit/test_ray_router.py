"""The prefix-affinity router's ranking, on fake replicas (no Ray cluster)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="the Ray Serve extra: pip install -e '.[ray]'")

from gyrfalcon.engine_api.types import EngineRequest, SamplingParams  # noqa: E402
from gyrfalcon.engine_process import codec  # noqa: E402
from gyrfalcon.ray.router import PrefixAffinityRouter, prefix_keys  # noqa: E402


class QueueLengths(dict):
    """Ray's queue-length cache: None for a replica it has no fresh length for."""


def router(imbalance: int = 4) -> PrefixAffinityRouter:
    r = object.__new__(PrefixAffinityRouter)  # Ray builds routers itself; the ranking needs no cluster
    r.initialize_state(block_size=4, imbalance=imbalance, max_blocks=8)
    r._replica_queue_len_cache = QueueLengths()
    return r


def pending(prompt: list[int], method: str = "generate", salt: str | None = None) -> SimpleNamespace:
    request = EngineRequest("r", prompt, SamplingParams(), cache_salt=salt)
    return SimpleNamespace(metadata=SimpleNamespace(call_method=method), args=[codec.encode_request(request)])


REPLICAS = [SimpleNamespace(replica_id=name) for name in ("a", "b", "c")]


def choose(r: PrefixAffinityRouter, request) -> list[list]:
    return asyncio.run(r.choose_replicas(REPLICAS, request))


def test_prefix_keys_chain_whole_blocks_and_the_salt():
    assert prefix_keys([1, 2, 3], 4) == []
    keys = prefix_keys(list(range(10)), 4)
    assert len(keys) == 2 and prefix_keys(list(range(8)) + [99, 98], 4) == keys
    assert prefix_keys([9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != keys[1]  # a block's key depends on all before it
    assert prefix_keys(list(range(8)), 4, "salt") != keys


def test_a_new_prefix_goes_to_the_least_loaded_then_its_continuation_follows_it():
    r = router()
    first = pending(list(range(12)))
    assert choose(r, first) == [REPLICAS]  # nothing held: one rank, Ray takes the least loaded
    r.on_request_routed(first, "b", None)
    turn_two = pending(list(range(12)) + [50, 51, 52, 53, 54])
    assert choose(r, turn_two) == [[REPLICAS[1]], [REPLICAS[0], REPLICAS[2]]]
    # a short prompt (no whole block) and other calls are load-balanced
    assert choose(r, pending([1, 2])) == [REPLICAS]
    assert choose(r, pending(list(range(12)), method="stats")) == [REPLICAS]
    # another salt shares nothing
    assert choose(r, pending(list(range(12)), salt="x")) == [REPLICAS]


def test_the_longest_match_wins_and_a_busy_replica_gives_way():
    r = router(imbalance=4)
    r.on_request_routed(pending(list(range(4))), "a", None)
    r.on_request_routed(pending(list(range(12))), "c", None)
    request = pending(list(range(16)))
    assert choose(r, request)[0] == [REPLICAS[2]]
    r._replica_queue_len_cache.update(a=0, b=1, c=5)  # c: 5 more than a, past the imbalance
    assert choose(r, request) == [REPLICAS]
    r._replica_queue_len_cache.update(c=4)
    assert choose(r, request)[0] == [REPLICAS[2]]


def test_what_a_replica_holds_is_bounded_and_forgotten_when_it_goes():
    r = router()
    r.on_request_routed(pending(list(range(40))), "a", None)  # 10 blocks, 8 kept: the first ones go
    assert r.matched_blocks("a", prefix_keys(list(range(40)), 4)) == 0
    r.on_request_routed(pending(list(range(8))), "a", None)
    assert r.matched_blocks("a", prefix_keys(list(range(8)), 4)) == 2
    r.forget_all_but({"b"})  # "a" is gone (a restarted replica has another id and an empty cache)
    assert r.matched_blocks("a", prefix_keys(list(range(8)), 4)) == 0


def test_replicas_that_hold_as_much_share_the_first_rank():
    """A system prompt every replica holds must not pin new conversations to one of them."""
    r = router()
    r.on_request_routed(pending(list(range(4)) + [7, 7, 7, 7]), "a", None)
    r.on_request_routed(pending(list(range(4)) + [8, 8, 8, 8]), "b", None)
    new_conversation = pending(list(range(4)) + [9, 9, 9, 9])
    assert choose(r, new_conversation) == [[REPLICAS[0], REPLICAS[1]], [REPLICAS[2]]]
    r.on_request_routed(new_conversation, "c", None)
    assert choose(r, new_conversation) == [[REPLICAS[2]], [REPLICAS[0], REPLICAS[1]]]
