"""What the sampler reads off a decode step's logits, computed where the logits are made.

Every decode step needs the same batch-shaped reductions of its ``[B, V]`` logits: each row's
argmax (greedy rows' token), its largest logit (a row with nothing left to choose, or NaN), the
raw log-softmax (the logprob gatherers' input) and the argmax's own logprob. :func:`heads_of`
computes them in one place. On a GPU the captured decode graph computes them inside the graph,
so after the replay a step of greedy rows runs no sampling kernel of its own, only the packing of
its one copy to the host; the static path (the same buffers run eagerly: the CPU tests) computes
them the same way. The sampler takes them only for a batch where no processor or ban changes any
row (:meth:`~gyrfalcon.engine.sample.sampler.Sampler.sample`); the eager steps and the CPU's
compiled step hand it plain logits (the
compiled step stays the model's forward: its bits are checked against the eager step's, and its
inductor cache stays valid).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepHeads:
    """A step's fp32 logits ``[n, V]`` and, where the step computed them, their reductions (each
    None otherwise): ``argmax`` and ``amax`` ``[n]``, ``logprobs`` (raw log-softmax) ``[n, V]``,
    ``own`` ``[n]`` (the log-probability of each row's argmax)."""

    logits: torch.Tensor
    argmax: torch.Tensor | None = None
    amax: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    own: torch.Tensor | None = None
    #: whether the tensors are buffers every step writes (read them before the next step)
    shared: bool = False

    @property
    def reduced(self) -> bool:
        """Whether the reductions are here (computed with the logits)."""
        return self.argmax is not None

    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.logits, self.argmax, self.amax, self.logprobs, self.own

    @property
    def nbytes(self) -> int:
        """The bytes its tensors hold."""
        return sum(t.numel() * t.element_size() for t in self._tensors() if t is not None)

    def first(self, n: int) -> StepHeads:
        """The first ``n`` rows (a padded bucket's real rows), as views."""
        if n == self.logits.shape[0]:
            return self
        return StepHeads(*(None if t is None else t[:n] for t in self._tensors()), shared=self.shared)

    def kept_logits(self) -> torch.Tensor:
        """The logits, in a tensor of their own where the step's buffers are shared (to hold them
        past the next step)."""
        return self.logits.clone() if self.shared else self.logits


def empty_heads(rows: int, width: int, device: torch.device) -> StepHeads:
    """Buffers for the heads of up to ``rows`` rows of ``width`` logits (:func:`heads_of`'s ``into``)."""
    f32 = dict(dtype=torch.float32, device=device)
    return StepHeads(torch.empty(rows, width, **f32), torch.empty(rows, dtype=torch.long, device=device),
                     torch.empty(rows, **f32), torch.empty(rows, width, **f32), torch.empty(rows, **f32))  # fmt: skip


def heads_of(logits: torch.Tensor, into: StepHeads | None = None) -> StepHeads:
    """The fp32 logits and every reduction of :class:`StepHeads`, the same operations the sampler
    runs on logits without them (so either way a row gets the same bits). ``into``: buffers of at
    least as many rows (:func:`empty_heads`) to write them to (the captured buckets share one set:
    each bucket's outputs are read before the next step runs)."""
    if into is None:
        logits = logits.float()
        argmax = logits.argmax(dim=-1)
        logprobs = logits.log_softmax(dim=-1)
        own = logprobs.gather(1, argmax.unsqueeze(1)).squeeze(1)
        return StepHeads(logits, argmax, logits.amax(dim=-1), logprobs, own)
    out = into.first(logits.shape[0])
    assert out.argmax is not None and out.amax is not None and out.logprobs is not None and out.own is not None
    out.logits.copy_(logits)
    torch.argmax(out.logits, dim=-1, out=out.argmax)
    torch.amax(out.logits, dim=-1, out=out.amax)
    torch.log_softmax(out.logits, dim=-1, out=out.logprobs)
    torch.gather(out.logprobs, 1, out.argmax.unsqueeze(1), out=out.own.unsqueeze(1))
    out.shared = True
    return out
