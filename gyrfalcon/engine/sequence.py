"""One choice being generated in the engine core: its token ids, logprobs, KV state and finish."""

from __future__ import annotations

from typing import Any

import torch

from gyrfalcon.engine.stopping import StopChecker
from gyrfalcon.engine_api.outputs import ChoiceProgress
from gyrfalcon.engine_api.types import EngineRequest, SamplingParams, TokenLogprobs


class Sequence(ChoiceProgress):
    """Choice ``index`` of a request. :meth:`append` applies the token-id stop rules (stop strings
    are the engine client's: it finishes the choice through the engine when one is hit).

    KV state (kept by the scheduler): ``blocks`` is the block table, ``computed`` how many of the
    sequence's tokens (prompt, then generated) have their KV in those blocks, ``block_hashes`` the
    prefix-cache keys of its full computed blocks. ``seed`` keys the sampling noise of every
    position (the request's child seed, or one drawn for it), so a recomputed sequence draws the
    same tokens.
    """

    #: the core produces no text: outputs carry token ids, the client decodes them
    text = ""

    def __init__(self, index: int, params: SamplingParams, prompt_token_ids: list[int], stopper: StopChecker,
                 seed: int = 0, weight_version: str = "") -> None:  # fmt: skip
        super().__init__(index)
        #: which weights make which tokens: ``[version, first token index]`` pairs, in order
        self.weight_versions: list[list[Any]] = [[weight_version, 0]]
        self._versions_sent = 0
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.stopper = stopper
        self.seed = seed
        self.blocks: list[int] = []
        self.computed = 0
        self.block_hashes: list[bytes] = []
        #: the scheduler's weights epoch when this sequence's KV began (its prefix-cache keys carry it)
        self.cache_epoch = 0

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens."""
        return len(self.prompt_token_ids) + len(self.token_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens ``start .. stop - 1`` of the prompt followed by the generated tokens."""
        prompt = len(self.prompt_token_ids)
        if stop <= prompt:
            return self.prompt_token_ids[start:stop]
        if start >= prompt:
            return self.token_ids[start - prompt : stop - prompt]
        return [*self.prompt_token_ids[start:], *self.token_ids[: stop - prompt]]

    def weights_replaced(self, version: str) -> None:
        """The weights are ``version`` from this choice's next token on (a no-op once finished)."""
        if self.finished:
            return
        start = len(self.token_ids)
        if self.weight_versions[-1][1] == start:  # nothing made by the weights before
            self.weight_versions[-1][0] = version
        else:
            self.weight_versions.append([version, start])

    def versions_to_send(self) -> list[list[Any]] | None:
        """The weight versions for this choice's next output: all of them when they changed since
        the last output (the first one included) or the choice has finished, else None."""
        if not self.finished and self._versions_sent == len(self.weight_versions):
            return None
        self._versions_sent = len(self.weight_versions)
        return [list(span) for span in self.weight_versions]

    def visible_text(self) -> str:
        return ""

    def append(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        """Add a generated token and decide whether the choice has finished."""
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.add_logprobs(logprobs)
        count = len(self.token_ids)
        token_stop = self.stopper.check_token(token_id, count)
        if token_stop is not None:
            self.finish(*token_stop)
        elif self.stopper.check_length(count):
            self.finish("length")


def choices_of(request: EngineRequest, eos_token_ids: list[int], max_model_len: int, seeds: torch.Generator,
               weight_version: str = "") -> list[Sequence]:  # fmt: skip
    """The ``n`` sequences of ``request``, each with its seed: the request's child seed, or for an
    unseeded choice one drawn from ``seeds``, so that a recomputed choice draws the same tokens;
    ``weight_version``: the weights served now."""
    params = request.sampling
    sequences = []
    for index in range(params.n):
        seed = params.child_seed(index)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=seeds))
        stopper = StopChecker(params, eos_token_ids, len(request.prompt_token_ids), max_model_len)
        sequences.append(Sequence(index, params, request.prompt_token_ids, stopper, seed, weight_version))
    return sequences
