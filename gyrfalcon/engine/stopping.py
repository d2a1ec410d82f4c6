"""When a choice stops on token ids (vLLM semantics); stop strings are the client's
(:mod:`gyrfalcon.client.stop_strings`), which tells the core to stop a choice that hit one.

Checked after every generated token, in this order:

1. eos (unless ``ignore_eos``) or a ``stop_token_ids`` member → ``"stop"`` (stop_reason None for
   eos, the token id otherwise); both only once ``min_tokens`` tokens exist;
2. ``max_tokens`` reached or the context full → ``"length"``.
"""

from __future__ import annotations

from gyrfalcon.engine_api.types import SamplingParams


class StopChecker:
    """The token-id stop rules of one choice."""

    def __init__(self, params: SamplingParams, eos_token_ids: list[int], prompt_len: int, max_model_len: int) -> None:
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.prompt_len = prompt_len
        self.max_model_len = max_model_len

    def check_token(self, token_id: int, num_generated: int) -> tuple[str, int | None] | None:
        """``("stop", stop_reason)`` when ``token_id`` ends the choice, else None."""
        if num_generated < self.params.min_tokens:
            return None
        if token_id in self.stop_token_ids:
            return "stop", token_id
        if token_id in self.eos_token_ids:
            return "stop", None
        return None

    def check_length(self, num_generated: int) -> bool:
        """True when ``max_tokens`` are generated or the context is full."""
        return num_generated >= self.params.max_tokens or self.prompt_len + num_generated >= self.max_model_len
