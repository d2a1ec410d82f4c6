"""Prefix-affinity routing for the engine replicas: Ray Serve's request-router hook.

A replica's engine keeps the KV blocks of the prompts it ran (automatic prefix caching, keyed by
chained hashes of whole blocks). This router keeps, per replica, the same kind of keys for the
prompts it sent there (bounded, least recently used first out), so it knows roughly what each
replica holds. For a ``generate`` call:

1. the replicas that hold the longest run of the prompt's leading blocks are ranked first, the
   others after them — Ray Serve takes the least loaded of the first rank unless their queues are
   full (``max_ongoing_requests``), then the least loaded of the rest; a replica whose queue is
   longer than the shortest by more than ``imbalance`` is left out of the first rank;
2. no replica holds the first block (or every one holds as much): one rank of every replica, so
   the least loaded one takes it (load first).

Each router (one per ingress replica) learns from its own requests only; with several ingress
replicas the affinity is per ingress. Other calls (info, health, stats) are routed to the least
loaded replica.
"""

from __future__ import annotations

import collections
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

#: request-router kwargs' defaults
DEFAULT_BLOCK_SIZE = 16
DEFAULT_IMBALANCE = 8
DEFAULT_MAX_BLOCKS = 1 << 16


def prefix_keys(token_ids: list[int], block_size: int, salt: str | None = None) -> list[int]:
    """Chained hashes of the whole blocks of ``token_ids`` (the salt seeds the chain, as in the
    engine's prefix cache: prompts of different salts never share a block)."""
    keys = []
    previous: int = hash(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, tuple(token_ids[start : start + block_size])))
        keys.append(previous)
    return keys


class PrefixAffinityRouter(RequestRouter):
    """Ranks the replica that already holds a request's prompt prefix first (see the module)."""

    def initialize_state(self, block_size: int = DEFAULT_BLOCK_SIZE, imbalance: int = DEFAULT_IMBALANCE,
                         max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:  # fmt: skip
        self._block_size = block_size
        self._imbalance = imbalance
        self._max_blocks = max_blocks
        self._held: dict[ReplicaID, collections.OrderedDict[int, None]] = {}

    def _keys(self, pending_request: PendingRequest | None) -> list[int]:
        if pending_request is None or pending_request.metadata.call_method != "generate" or not pending_request.args:
            return []
        request = pending_request.args[0]  # the engine request, as gyrfalcon.engine_api.codec encodes it
        return prefix_keys(request[1], self._block_size, request[5])

    def matched_blocks(self, replica_id: ReplicaID, keys: list[int]) -> int:
        """How many of ``keys``' leading blocks ``replica_id`` was sent."""
        held = self._held.get(replica_id)
        if not held:
            return 0
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:  # fmt: skip
        keys = self._keys(pending_request)
        matched = {r.replica_id: self.matched_blocks(r.replica_id, keys) for r in candidate_replicas}
        most = max(matched.values(), default=0)
        # ties (a system prompt every replica holds) stay together: Ray takes the least loaded of them
        best = [r for r in candidate_replicas if most and matched[r.replica_id] == most and not self._too_busy(r, candidate_replicas)]
        if not best or len(best) == len(candidate_replicas):
            return [candidate_replicas]
        return [best, [r for r in candidate_replicas if r not in best]]

    def _too_busy(self, replica: RunningReplica, candidates: list[RunningReplica]) -> bool:
        """``replica``'s queue is known to be ``imbalance`` longer than another replica's."""
        lengths = {r.replica_id: self._replica_queue_len_cache.get(r.replica_id) for r in candidates}
        mine = lengths.get(replica.replica_id)
        known = [n for n in lengths.values() if n is not None]
        return mine is not None and bool(known) and mine - min(known) > self._imbalance

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        keys = self._keys(pending_request)
        if not keys:
            return
        held = self._held.setdefault(replica_id, collections.OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self._max_blocks:
            held.popitem(last=False)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.forget_all_but({r.replica_id for r in replicas})

    def forget_all_but(self, live: set[ReplicaID]) -> None:
        """Drop what replicas that are gone held (a restarted replica starts with an empty cache)."""
        for replica_id in [r for r in self._held if r not in live]:
            del self._held[replica_id]
