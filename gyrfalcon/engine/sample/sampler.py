"""The token chooser: processors on the batch, then greedy argmax or one seeded draw per row (inverse CDF).

One ``[B, V]`` pass per step, over rows that come from the persistent batch
(:mod:`gyrfalcon.engine.sample.persistent_batch`: which rows want which policy was decided when
each sequence joined):

1. the values the logprob gatherers read — the single hook point :meth:`Sampler.gather_logprobs`,
   which also receives the sampled ids; their results stay on the device — are what the engine's
   logprobs mode names (``engine_api.config.LOGPROBS_MODES``): by default the raw log-softmax,
   before any processor; the ``processed`` modes read the logits step 4 draws from;
2. ``min_tokens``: stop token ids (and eos unless ``ignore_eos``) are masked until enough tokens
   have been generated (vLLM's rule, :mod:`gyrfalcon.engine.sample.min_tokens`), on the rows that
   asked for it; the engine's rows carry the banned pairs, sent with the step's inputs;
3. the plugin processors run in ascending ``order``, each on the rows that want it;
4. greedy rows (temperature < 1e-5) take the argmax; the others invert their distribution's CDF
   at one uniform number per row (``BatchRows.uniforms``: a device-side function of the choice's
   seed and the position it draws), so a seeded row samples the same token whatever its batch
   company, and again when it is recomputed after a preemption;
5. one host transfer carries the sampled ids, each row's largest processed logit and every
   gathered logprob. A row left with no token to choose (every logit ``-inf``: the request's
   constraints exclude everything) or with NaN logits gets no token but an in-band error
   (:attr:`SamplerOutput.errors`); the other rows are sampled as usual.

Processors and bans work on a copy of the step's logits, made only when some row has one. A step
that computed its logits' reductions where it made them (a captured decode graph:
:mod:`gyrfalcon.engine.model.heads`) hands them over; where no processor or ban changes any row
of the batch, the greedy rows' argmax, every row's largest logit, the raw log-softmax and the argmax's own
logprob are taken from there instead of being computed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gyrfalcon.engine.model.heads import StepHeads
from gyrfalcon.engine.sample.min_tokens import banned_pairs
from gyrfalcon.engine.sample.logprob_reports import PendingReports, gather_pending, to_host
from gyrfalcon.engine.sample.persistent_batch import MIN_TOKENS_ROWS, SAMPLING_ROWS
from gyrfalcon.engine.sample.prompt_logprobs import compute_prompt_logprobs
from gyrfalcon.engine_api.types import EngineError, EngineRequest, SamplingParams, TokenLogprobs
from gyrfalcon.policies import (
    BatchRows,
    LogitsProcessor,
    LogprobGatherer,
    to_device,
    put_rows,
    row_index,
    take_rows,
)

#: the request fields that can exclude tokens, most specific first (the in-band error's ``param``)
_EXCLUDING_FIELDS = ("structured_outputs", "allowed_token_ids", "bad_words")


def excluded_error(params: SamplingParams, generated: int) -> EngineError:
    """The 400 for a row whose every token is excluded, naming the constraints that were active."""
    active = [name for name in _EXCLUDING_FIELDS if getattr(params, name)]
    if generated < params.min_tokens:
        active.append("min_tokens")
    detail = f" ({', '.join(active)})" if active else ""
    return EngineError(
        f"every token is excluded by the request's constraints{detail}: nothing can be generated",
        type="invalid_request_error",
        param=next((name for name in _EXCLUDING_FIELDS if getattr(params, name)), None),
    )


NAN_ERROR = "internal error: the logits of this sequence are NaN (numerical overflow)"


@dataclass
class SamplerOutput:
    """Per row: the sampled token id and, for rows whose request asked, its logprob entry.

    ``errors`` maps the rows that could not be sampled to their in-band error; their ``token_ids``
    entry is meaningless and must not be appended.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    errors: dict[int, EngineError] = field(default_factory=dict)
    #: the same ids, still on the device (``[B]``; possibly the step's shared buffer: read before the next step)
    device_ids: torch.Tensor | None = None


class Sampler:
    """Applies the engine's processors and gatherers (resolved once at start) to a batch."""

    def __init__(
        self,
        processors: list[LogitsProcessor],
        gatherers: list[LogprobGatherer],
        eos_token_ids: list[int],
        default_generator: torch.Generator,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        self.processors = sorted(processors, key=lambda p: p.order)
        # logprob path: generated-position gatherers run each step, prompt-position ones after a prefill
        self.gatherers = [g for g in gatherers if getattr(g, "positions", "generated") == "generated"]
        self.prompt_gatherers = [g for g in gatherers if getattr(g, "positions", "generated") == "prompt"]
        self.eos_token_ids = list(eos_token_ids)
        self.default_generator = default_generator
        #: what the gatherers read (``engine_api.config.LOGPROBS_MODES``)
        self.logprobs_mode = logprobs_mode

    def _selected(self, policy, rows: BatchRows) -> list[int]:
        if rows.selected is not None:
            return rows.selected.get(id(policy), [])
        extensions = rows.extensions or [{}] * len(rows)
        return [i for i in range(len(rows)) if policy.wants(rows.params[i], extensions[i])]

    def _min_tokens_bans(self, rows: BatchRows, device: torch.device) -> torch.Tensor | None:
        """``[2, k]``: the (row, token id) pairs ``min_tokens`` bans this step, on the logits' device
        (staged with the step's inputs where the engine's rows carry them); None: none."""
        if rows.min_tokens_bans is not None:
            return rows.min_tokens_bans if rows.min_tokens_bans.shape[1] else None
        candidates = range(len(rows)) if rows.selected is None else rows.selected.get(MIN_TOKENS_ROWS, ())
        if not candidates:
            return None
        generated = [len(ids) for ids in rows.output_token_ids]
        banned_rows, banned_ids = banned_pairs(rows.params, generated, self.eos_token_ids, candidates)
        return to_device([*banned_rows, *banned_ids], device).view(2, -1) if banned_rows else None

    def unsampleable(self, top: list[float], rows: BatchRows) -> dict[int, EngineError]:
        """The rows with nothing to choose, from each row's largest processed logit (``amax``,
        which propagates NaN): all ``-inf`` (the request's constraints, 400) or NaN (500)."""
        errors: dict[int, EngineError] = {}
        for i, value in enumerate(top):
            if math.isnan(value):
                errors[i] = EngineError(NAN_ERROR)
            elif value == -math.inf:
                errors[i] = excluded_error(rows.params[i], len(rows.output_token_ids[i]))
        return errors

    def _uniforms(self, rows: BatchRows, random_rows: list[int], index: torch.Tensor | None,
                  device: torch.device) -> torch.Tensor:  # fmt: skip
        if rows.uniforms is not None:
            return rows.uniforms if index is None else rows.uniforms.index_select(0, index)
        values = []  # rows built by hand: one draw from each row's generator, or the engine's
        for i in random_rows:
            generator = (rows.generators[i] if rows.generators else None) or self.default_generator
            values.append(float(torch.rand(1, generator=generator, device=generator.device, dtype=torch.float64)))
        return torch.tensor(values, dtype=torch.float64, device=device)

    def choose(self, logits: torch.Tensor, rows: BatchRows, argmax: torch.Tensor | None = None) -> torch.Tensor:
        """``[B]`` token ids from processed logits: argmax for greedy rows (``argmax``: theirs, when
        the step computed it; returned as it is when every row is greedy), inverse CDF otherwise."""
        if rows.selected is not None:
            random_rows = rows.selected.get(SAMPLING_ROWS, [])
        else:
            random_rows = [i for i, params in enumerate(rows.params) if not params.greedy]
        if argmax is not None and not random_rows:
            return argmax
        chosen = logits.argmax(dim=-1) if argmax is None else argmax.clone()
        if random_rows:
            device = logits.device
            index = row_index(random_rows, logits)
            uniforms = self._uniforms(rows, random_rows, index, device)
            # fp64 sums: the CDF's last entries stay exact enough over a large vocabulary
            cdf = take_rows(logits, index).float().softmax(dim=-1).double().cumsum(dim=-1)
            target = (uniforms * cdf[:, -1]).unsqueeze(1)
            picked = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(logits.shape[-1] - 1)
            put_rows(chosen, index, picked)
        return chosen

    def gather_logprobs(self, raw_logprobs: torch.Tensor | None, sampled: torch.Tensor, rows: BatchRows,
                        selected: list[list[int]], own: torch.Tensor | None = None) -> PendingReports | None:  # fmt: skip
        """The logprob hook point: every gatherer on the rows it wants, results left on the device.

        ``raw_logprobs`` is the log-softmax of the step's unprocessed logits; ``selected[g]`` lists
        the rows gatherer ``g`` wants. A row's report will hold the sampled token and its logprob,
        then every gatherer's ids in gatherer order without duplicates (see
        :class:`gyrfalcon.engine.sample.logprob_reports.PendingReports`); values are finite. ``own``:
        the sampled tokens' logprobs where the step computed them.
        """
        if raw_logprobs is None:
            return None
        return gather_pending(self.gatherers, raw_logprobs, sampled, rows, selected, own)

    def gather_prompt_logprobs(self, logits: torch.Tensor, request: EngineRequest, start: int = 0) -> TokenLogprobs:
        """Prompt logprobs from a prefill chunk's ``[c, V]`` logits, prompt positions ``start ..``
        (row j predicts prompt token start + j + 1); see :func:`compute_prompt_logprobs`."""
        return compute_prompt_logprobs(logits, request, self.prompt_gatherers, start,
                                       as_logits=self.logprobs_mode.endswith("_logits"))

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: BatchRows, heads: StepHeads | None = None) -> SamplerOutput:
        """Sample one token per row of ``[B, V]`` fp32 logits (left as they are: processors work on a
        copy). ``heads``: the step's reductions of the same logits
        (:mod:`~gyrfalcon.engine.model.heads`), taken where no processor or ban changes any row."""
        gathered = [self._selected(g, rows) for g in self.gatherers]
        applied = [(p, selected) for p in self.processors if (selected := self._selected(p, rows))]
        banned = self._min_tokens_bans(rows, logits.device)
        reduced = heads if heads is not None and heads.reduced else None
        mode = self.logprobs_mode if any(gathered) else None
        read = None  # what the gatherers read
        if mode == "raw_logprobs":
            read = reduced.logprobs if reduced is not None else logits.float().log_softmax(dim=-1)
        elif mode == "raw_logits":
            read = logits.float()
        if applied or banned is not None:
            reduced, logits = None, logits.clone()  # the caller's logits serve again if this batch fails
            if banned is not None:
                logits[banned[0], banned[1]] = -math.inf
            for processor, selected in applied:
                logits = processor(logits, rows, selected)
        if mode == "processed_logprobs":
            read = reduced.logprobs if reduced is not None else logits.float().log_softmax(dim=-1)
        elif mode == "processed_logits":
            read = logits.float()
        top = logits.amax(dim=-1) if reduced is None else reduced.amax
        sampled = self.choose(logits, rows, None if reduced is None else reduced.argmax)
        own = reduced.own if reduced is not None and sampled is reduced.argmax and mode is not None and mode.endswith("_logprobs") else None
        pending = self.gather_logprobs(read, sampled, rows, gathered, own)
        # the step's one host transfer: ids, each row's largest logit and the gathered logprobs
        host = to_host([sampled, top, *(pending.tensors if pending is not None else ())])
        ids, tops = host[0], host[1]
        errors = self.unsampleable(tops, rows)
        reports = pending.finish(host[2:]) if pending is not None else [None] * len(rows)
        return SamplerOutput([int(i) for i in ids], reports, errors, sampled)
