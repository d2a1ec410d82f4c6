"""Prompt log-probabilities from the logits of the prefill that already ran (no second forward).

The prefill of a prompt of ``L`` tokens yields ``[L, V]`` logits when prompt logprobs are asked for:
row ``t`` is the distribution that predicted prompt token ``t + 1``. Prompt position 0 has no
logprob (nothing predicted it) and is reported as ``None``; positions ``1..L-1`` go through the
engine's prompt-position gatherers (``LogprobGatherer.positions == "prompt"``) as one batch of
``L - 1`` rows, each carrying the request's parameters, so the same vectorised gather and the same
merge rules as generated positions apply. The engine calls it once per prefill chunk (``start``),
so a long prompt's logits are never held, or log-softmaxed, all at once.

Every token a prompt position reports also gets its rank (vLLM's ``Logprob.rank``): the prompt
token's is counted on the device over the whole vocabulary (how many tokens are at least as likely);
a listed top token's is its place in the top list.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gyrfalcon.engine.sample.logprob_reports import finite, merge_gathered
from gyrfalcon.engine_api.types import EngineRequest, TokenLogprobs
from gyrfalcon.policies import BatchRows, LogprobGatherer


@torch.inference_mode()
def compute_prompt_logprobs(
    logits: torch.Tensor, request: EngineRequest, gatherers: Sequence[LogprobGatherer], start: int = 0,
    as_logits: bool = False,
) -> TokenLogprobs:
    """The prompt's :class:`TokenLogprobs`: ``L`` positions, the first with ``None``.

    ``logits``: ``[L, V]`` (or ``[L', V]`` with ``L' >= L - 1``; only rows ``0..L-2`` are read).
    ``gatherers``: the prompt-position gatherers; a position no gatherer reports still carries its
    own token and logprob, with no alternatives.

    Chunk by chunk: with ``start > 0``, ``logits`` row ``j`` is prompt position ``start + j`` and
    the result holds only the prompt tokens ``start + 1 ..`` those rows predict (a row past the
    prompt's end is not read); the chunks' results, joined in order, equal the whole prompt's.
    ``as_logits``: report the logits themselves (the ``*_logits`` logprobs modes; no sampling
    parameter applies at a prompt position, so the ``processed`` modes report what the raw ones do).
    """
    prompt = list(request.prompt_token_ids)
    result = TokenLogprobs([prompt[0]], [None], [[]], [[]], [None], [[]]) if start == 0 else TokenLogprobs()
    positions = min(int(logits.shape[0]), len(prompt) - 1 - start)
    if positions <= 0:
        return result
    raw = logits[:positions].float() if as_logits else logits[:positions].float().log_softmax(dim=-1)
    tokens = torch.tensor(prompt[start + 1 : start + 1 + positions], dtype=torch.long, device=raw.device)
    rows = BatchRows(
        params=[request.sampling] * positions,
        prompt_token_ids=[prompt] * positions,
        output_token_ids=[[] for _ in range(positions)],
        extensions=[request.extensions] * positions,
    )
    everyone = list(range(positions))
    selected = [everyone if g.wants(request.sampling, request.extensions) else [] for g in gatherers]
    reports = merge_gathered(gatherers, raw, tokens, rows, selected)
    own: list[float] | None = None
    chunk = TokenLogprobs()
    for p, report in enumerate(reports):
        if report is None:  # no gatherer reported this position: its own token only
            if own is None:
                own = raw.gather(1, tokens.view(-1, 1)).view(-1).tolist()
            report = TokenLogprobs([prompt[start + p + 1]], [finite(own[p])], [[]], [[]])
        chunk.extend(report)
    chunk.ranks, chunk.top_ranks = _ranks(raw, chunk)
    result.extend(chunk)
    return result


#: most ``[rows, vocabulary]`` comparisons held at once while counting ranks
_RANK_CELLS = 1 << 25


def _ranks(raw: torch.Tensor, positions: TokenLogprobs) -> tuple[list[int], list[list[int]]]:
    """vLLM's ranks: the prompt token's is the count of tokens at least as likely as it in ``raw``
    (``[P, V]`` log-softmax; one comparison per row block); a listed top token's is its place in
    the top list (1 = the most likely)."""
    own = raw.gather(1, torch.tensor(positions.token_ids, dtype=torch.long, device=raw.device).view(-1, 1))
    rows = max(1, _RANK_CELLS // raw.shape[1])
    counts = torch.cat([(raw[r : r + rows] >= own[r : r + rows]).sum(-1) for r in range(0, raw.shape[0], rows)])
    return counts.tolist(), [list(range(1, len(top) + 1)) for top in positions.top_token_ids]
