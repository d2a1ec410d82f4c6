"""The block pool: which KV blocks are free, shared or cached — pure bookkeeping, no tensors.

The cache is ``num_blocks`` blocks of ``block_size`` token slots each. Block 0 is never handed out:
it is the scratch block that padding rows of a captured step write to and read from. Every other
block is either in use (reference count ≥ 1: one per sequence whose block table lists it — the
``n`` children of a request share their prompt's full blocks) or free.

Automatic prefix caching: a block whose slots are all computed gets the hash of its tokens chained
to the hash of the block before it (and the request's cache salt), so equal prompt prefixes map to
equal hash chains. A freed block keeps its hash and stays findable until it is handed out again;
free blocks are reused least recently freed first, so the hottest prefixes survive longest.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence


class NoFreeBlocks(Exception):
    """Raised by :meth:`BlockPool.allocate` when every block is in use."""


def chain_hash(parent: bytes | None, tokens: Sequence[int], salt: str | None = None, epoch: int = 0,
               adapter: int = 0) -> bytes:  # fmt: skip
    """The prefix-cache key of a full block: its tokens, chained to the previous block's key, and the
    request's cache salt, the weights' epoch its sequence began in and the LoRA adapter it runs
    with (its load's serial; 0: none) (each length-prefixed: no salt's bytes spell another's salt,
    epoch and adapter)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent or b"root")
    if salt:
        raw = salt.encode("utf-8")
        digest.update(b"salt:%d:" % len(raw) + raw)
    if epoch:
        digest.update(b"epoch:%d;" % epoch)
    if adapter:
        digest.update(b"lora:%d;" % adapter)
    digest.update(b",".join(str(t).encode() for t in tokens))
    return digest.digest()


class BlockPool:
    """Reference-counted blocks with a least-recently-freed queue and a prefix-hash index."""

    SCRATCH = 0

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is the scratch block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refs = [0] * num_blocks
        self.refs[self.SCRATCH] = 1  # never freed, never handed out
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(1, num_blocks))
        #: prefix-cache counters (blocks looked up / found), reported by the engine's stats()
        self.queries = 0
        self.hits = 0

    @property
    def usable_blocks(self) -> int:
        """Blocks a request may ever hold (all but the scratch block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def stats(self) -> dict[str, int]:
        """The pool's figures for the engine's stats (``/metrics``)."""
        return {"kv_blocks_total": self.usable_blocks, "kv_block_size": self.block_size, "kv_blocks_free": self.num_free,
                "prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits}  # fmt: skip

    def allocate(self) -> int:
        """A block for new KV (reference count 1); a cached free block loses its hash."""
        if not self._free:
            raise NoFreeBlocks
        block, _ = self._free.popitem(last=False)
        self._forget_hash(block)
        self.refs[block] = 1
        return block

    def share(self, block: int) -> int:
        """One more reference to ``block`` (a forked child, or a prefix-cache hit on a free block)."""
        if self.refs[block] == 0:
            del self._free[block]
        self.refs[block] += 1
        return block

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a block nobody holds becomes free (keeping its hash)."""
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self._free[block] = None
            elif self.refs[block] < 0:  # pragma: no cover - a bookkeeping bug, never a user error
                raise AssertionError(f"block {block} released more often than held")

    def register(self, block: int, key: bytes) -> None:
        """Record that ``block`` holds the computed KV of the full block whose chain hash is ``key``."""
        if not self.enable_prefix_caching or self._hash_of[block] is not None:
            return
        if key in self._cached:  # an equal block exists already: keep the first one findable
            return
        self._hash_of[block] = key
        self._cached[key] = block

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``keys`` (not yet shared: see :meth:`share`)."""
        if not self.enable_prefix_caching or not keys:
            return []
        found = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            found.append(block)
        self.queries += len(keys)
        self.hits += len(found)
        return found

    def forget_prefixes(self) -> None:
        """No block is findable by its prefix any more (a pause that asks for it; a sleep, which hands their KV back):
        blocks in use stay their holders'; free ones are plain free blocks."""
        for block in range(self.num_blocks):
            self._forget_hash(block)

    def _forget_hash(self, block: int) -> None:
        key = self._hash_of[block]
        if key is not None:
            self._hash_of[block] = None
            if self._cached.get(key) == block:
                del self._cached[key]
