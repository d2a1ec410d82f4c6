"""Prompt-lookup proposals (vLLM's ``ngram`` method): the tokens that followed the last earlier
place where a sequence's trailing n-gram appeared.

For each sequence an :class:`NgramIndex` keeps, for every n-gram length from ``prompt_lookup_min``
to ``prompt_lookup_max``, the end of the latest occurrence of each n-gram seen so far, updated as
tokens are appended: a proposal is one dictionary look-up per length (the longest length that
matches wins), never a scan of the sequence, so it costs the same at any context.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """The latest end of every n-gram (``n_min .. n_max`` tokens) of one token sequence."""

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min <= max, got {n_min} and {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        #: per length, n-gram → the index just past its latest occurrence
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self._pending: dict[int, tuple[tuple[int, ...], int]] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens``. Each n-gram is indexed once a token follows it, so the trailing
        n-gram never finds itself."""
        for token in tokens:
            for n, (gram, end) in self._pending.items():
                self._ends[n][gram] = end
            self._pending = {}
            self.tokens.append(token)
            size = len(self.tokens)
            for n in self._ends:
                if size >= n:
                    self._pending[n] = (tuple(self.tokens[size - n :]), size)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the trailing n-gram
        (the longest length that occurred before); none when no trailing n-gram occurred before."""
        size = len(self.tokens)
        for n in range(self.n_max, self.n_min - 1, -1):
            if size < n:
                continue
            end = self._ends[n].get(tuple(self.tokens[size - n :]))
            if end is not None:
                return self.tokens[end : end + k]
        return []
