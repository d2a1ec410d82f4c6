"""Prefix caching's keys: the cached blocks a fresh sequence starts from, and the keys of the blocks
a step filled (the :class:`~gyrfalcon.engine.kv.blocks.BlockPool` finds blocks by them).

A full block's key chains its tokens to the key of the block before it, with the request's cache
salt, the weights' epoch its sequence began in (:attr:`Sequence.cache_epoch`, one more at each
weight swap) and the LoRA adapter it runs with (two adapters, or an adapter and the base model,
never share a block). A sequence keeps its epoch while it runs, so the blocks it fills after a swap — its
earlier KV and the new weights' work mixed — are found only by chains of the old epoch, which no
sequence begun after the swap follows; the old weights' blocks stay cached until handed out again,
found by nothing new.
"""

from __future__ import annotations

from typing import Any

from gyrfalcon.engine.kv.blocks import BlockPool, chain_hash


def block_key(pool: BlockPool, seq: Any, parent: bytes | None, b: int, salt: str | None) -> bytes:
    """The key of ``seq``'s full block ``b`` after the key ``parent``."""
    bs = pool.block_size
    lora = getattr(seq, "lora", None)
    return chain_hash(parent, seq.tokens(b * bs, (b + 1) * bs), salt, seq.cache_epoch, lora.serial if lora else 0)


def start_from_cache(pool: BlockPool, seq: Any, salt: str | None) -> None:
    """A fresh sequence takes the cached blocks of its longest cached prefix of full blocks (never
    its last token's), counted as computed."""
    if not pool.enable_prefix_caching:
        return
    keys: list[bytes] = []
    parent = None
    for b in range((seq.num_tokens - 1) // pool.block_size):
        parent = block_key(pool, seq, parent, b, salt)
        keys.append(parent)
    hits = pool.lookup(keys)
    seq.blocks = [pool.share(block) for block in hits]
    seq.block_hashes = keys[: len(hits)]
    seq.computed = len(hits) * pool.block_size


def register_full_blocks(pool: BlockPool, seq: Any, salt: str | None) -> None:
    """Record the key of every block of ``seq`` that is full and computed and has none yet."""
    if not pool.enable_prefix_caching:
        return
    while len(seq.block_hashes) < seq.computed // pool.block_size:
        b = len(seq.block_hashes)
        key = block_key(pool, seq, seq.block_hashes[-1] if seq.block_hashes else None, b, salt)
        seq.block_hashes.append(key)
        pool.register(seq.blocks[b], key)
