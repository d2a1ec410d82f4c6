"""``min_tokens`` (vLLM's rule): until a choice has generated ``min_tokens`` tokens, its stop token
ids — and the end-of-text ids, unless ``ignore_eos`` — cannot be drawn."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gyrfalcon.engine_api.types import SamplingParams


def banned_pairs(params: Sequence[SamplingParams], generated: Sequence[int], eos_token_ids: Sequence[int],
                 candidates: Iterable[int]) -> tuple[list[int], list[int]]:  # fmt: skip
    """The ``(rows, token ids)`` the rule bans at this draw, among the rows ``candidates`` (row
    ``i`` asks with ``params[i]`` and has generated ``generated[i]`` tokens)."""
    rows: list[int] = []
    ids: list[int] = []
    for i in candidates:
        if generated[i] >= params[i].min_tokens:
            continue
        banned = [*params[i].stop_token_ids, *(() if params[i].ignore_eos else eos_token_ids)]
        rows.extend([i] * len(banned))
        ids.extend(banned)
    return rows, ids
