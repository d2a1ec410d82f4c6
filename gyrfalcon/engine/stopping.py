"""When a choice stops, and how its text is cut (vLLM semantics).

Checked after every generated token, in this order:

1. eos (unless ``ignore_eos``) or a ``stop_token_ids`` member → ``"stop"`` (stop_reason None for
   eos, the token id otherwise); both only once ``min_tokens`` tokens exist;
2. a stop string in the new text, only once ``min_tokens`` tokens exist → ``"stop"``, the text cut
   before it (or after it with ``include_stop_str_in_output``), stop_reason the string;
3. ``max_tokens`` reached or the context full → ``"length"``.
"""

from __future__ import annotations

from gyrfalcon.engine.types import SamplingParams


class StopChecker:
    """The stop rules of one choice."""

    def __init__(self, params: SamplingParams, eos_token_ids: list[int], prompt_len: int, max_model_len: int) -> None:
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.stop = [s for s in params.stop if s]
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
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

    def check_text(self, text: str, new_chars: int, num_generated: int) -> tuple[str, int] | None:
        """``(stop_string, cut_length)`` for the earliest stop string ending in the new text."""
        if not self.stop or num_generated < self.params.min_tokens or new_chars <= 0:
            return None
        start = max(0, len(text) - new_chars - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            position = text.find(stop, start)
            if position >= 0 and (best is None or position < best[0]):
                best = (position, stop)
        if best is None:
            return None
        position, stop = best
        cut = position + len(stop) if self.params.include_stop_str_in_output else position
        return stop, cut

    def check_length(self, num_generated: int) -> bool:
        """True when ``max_tokens`` are generated or the context is full."""
        return num_generated >= self.params.max_tokens or self.prompt_len + num_generated >= self.max_model_len

    def holdback(self, text: str) -> int:
        """How many trailing characters could still begin a stop string (not to be sent yet)."""
        if not self.stop or self.params.include_stop_str_in_output:
            return 0
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
