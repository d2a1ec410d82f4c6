"""One choice being generated in the engine core: its token ids, logprobs, KV state and finish."""

from __future__ import annotations

from gyrfalcon.engine.stopping import StopChecker
from gyrfalcon.engine_api.outputs import ChoiceProgress
from gyrfalcon.engine_api.types import SamplingParams, TokenLogprobs


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
                 seed: int = 0) -> None:  # fmt: skip
        super().__init__(index)
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.stopper = stopper
        self.seed = seed
        self.blocks: list[int] = []
        self.computed = 0
        self.block_hashes: list[bytes] = []

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
