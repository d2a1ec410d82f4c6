"""Base classes of the batch-shaped engine policies that plugins provide.

A policy object is small and pure: it sees a whole batch at once (``[B, V]`` logits) and the per-row
parameters in a :class:`BatchRows`. It declares which request fields it understands (``fields``), so
the engine can report them as capabilities, and validates them synchronously at submit time.
This module imports no torch: the frontend may import it to read declarations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gyrfalcon.engine_api.types import EngineInfo, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass
class BatchRows:
    """Per-row state of a batch, aligned with the rows of the logits tensor.

    ``generators`` holds each sampling row's ``torch.Generator`` on the logits' device, seeded for
    this draw from (the choice's seed, the index of the token being drawn) — so a choice preempted
    and recomputed, or batched with any company, draws the same noise; None for greedy rows. A
    processor that needs randomness draws from its row's generator.
    """

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    extensions: list[dict[str, Any]] = field(default_factory=list)
    generators: list[Any] = field(default_factory=list)
    #: per row, the uniform number in [0, 1) its token is drawn with (from the same seed and position)
    uniforms: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.params)


def row_index(selected: list[int], logits: torch.Tensor) -> torch.Tensor:
    """The rows listed in ``selected`` as an index tensor on the logits' device (for ``index_select``)."""
    import torch

    return torch.tensor(selected, dtype=torch.long, device=logits.device)


class LogitsProcessor:
    """Transforms a batch of next-token logits; subclasses set the class attributes.

    - ``name``: unique, for allowlists and errors.
    - ``fields``: the ``SamplingParams`` field names (or ``extensions`` keys) this processor honours.
    - ``order``: processors run in ascending order (penalties and biases < 100 ≤ temperature <
      200 ≤ truncation such as top-k/top-p/min-p).
    """

    name: str = ""
    fields: frozenset[str] = frozenset()
    order: int = 0

    def validate(self, params: SamplingParams, extensions: dict[str, Any], info: EngineInfo) -> None:
        """Raise :class:`gyrfalcon.errors.RequestError` (with ``param``) for values it cannot honour."""

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        """True when this row needs the processor (rows that don't are left untouched)."""
        raise NotImplementedError

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        """Return the processed ``[B, V]`` logits; only the rows listed in ``selected`` may change."""
        raise NotImplementedError


class LogprobGatherer:
    """Chooses which log-probabilities to report at each position.

    ``gather`` receives the raw log-softmax ``[B, V]`` of the batch (before processors), the sampled
    token of each row, and the rows; it returns, per row, either None (nothing from this gatherer)
    or a pair ``(token_ids, logprobs)`` of equal-length lists to add to that position's report.
    The engine merges the pairs of every gatherer in order, without duplicates.

    ``positions`` says where the gatherer runs: ``"generated"`` (every decode step, on the rows of
    the batch) or ``"prompt"`` (once per request after its prefill, one row per prompt position
    ``1..L-1``: ``logprobs[p]`` is the distribution that predicted prompt token ``p + 1``, which
    is passed as ``sampled[p]``; every row carries the request's parameters).
    """

    name: str = ""
    fields: frozenset[str] = frozenset()
    positions: str = "generated"

    def validate(self, params: SamplingParams, extensions: dict[str, Any], info: EngineInfo) -> None:
        """Raise :class:`gyrfalcon.errors.RequestError` (with ``param``) for values it cannot honour."""

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        """True when this row (request) needs the gatherer."""
        raise NotImplementedError

    def gather(
        self, logprobs: torch.Tensor, sampled: torch.Tensor, rows: BatchRows, selected: list[int]
    ) -> list[tuple[list[int], list[float]] | None]:
        """Per row of the batch (``len(rows)`` items): ``(token_ids, logprobs)`` or None.

        Only rows in ``selected`` may get a pair; an empty pair still asks for the position's
        report (the sampled token and its logprob). Vectorise across ``selected``.
        """
        raise NotImplementedError
