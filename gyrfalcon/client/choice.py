"""One choice on the client side: the core's token ids turned into text, and its stop strings."""

from __future__ import annotations

from typing import Any

from gyrfalcon.client.detokenizer import IncrementalDetokenizer, NoText
from gyrfalcon.client.stop_strings import StopStrings
from gyrfalcon.engine_api.outputs import ChoiceProgress
from gyrfalcon.engine_api.types import CompletionOutput, SamplingParams, TokenLogprobs


class ChoiceText(ChoiceProgress):
    """Choice ``index`` of a request as the client sends it.

    ``text`` is everything decoded so far (cut at a stop string); :meth:`visible_text` is what may
    be sent while the choice runs (a possible stop-string start is held back). Tokens the core
    produced after the client finished the choice are dropped.
    """

    def __init__(self, index: int, params: SamplingParams, detokenizer: IncrementalDetokenizer | NoText) -> None:
        super().__init__(index)
        self.params = params
        self.detokenizer = detokenizer
        self.stops = StopStrings(params)
        self.text = ""
        #: which weights made which tokens, as the engine last said (``CompletionOutput.weight_versions``)
        self.weight_versions: list[list[Any]] | None = None

    def visible_text(self) -> str:
        if self.finished:
            return self.text
        held = self.stops.held()
        return self.text[: len(self.text) - held] if held else self.text

    def add(self, delta: CompletionOutput) -> bool:
        """Apply one core delta of this choice; True when a stop string ended the choice now."""
        if delta.weight_versions is not None:
            self.weight_versions = delta.weight_versions
        if self.finished:
            return False
        ids = delta.token_ids
        for i, token_id in enumerate(ids):
            self.token_ids.append(token_id)
            if delta.logprobs is not None and i < len(delta.logprobs.token_ids):
                self.add_logprobs(_position(delta.logprobs, i))
            if i == len(ids) - 1 and delta.finish_reason == "stop":  # a stop token or eos ended it
                # vLLM: the stop token's own text is part of the output only with include_stop_str_in_output
                if self.params.include_stop_str_in_output:
                    self.text += self.detokenizer.add(token_id)
                self.text += self.detokenizer.flush()
                self.finish("stop", delta.stop_reason)
                return False
            new = self.detokenizer.add(token_id)
            self.text += new
            hit = self.stops.check_text(self.text, len(self.token_ids))
            if hit is not None:
                stop, cut = hit
                self.text = self.text[:cut]
                self.finish("stop", stop)
                return True
        if delta.finish_reason is not None:
            self.text += self.detokenizer.flush()
            self.finish(delta.finish_reason, delta.stop_reason)
        return False


def _position(logprobs: TokenLogprobs, i: int) -> TokenLogprobs:
    return TokenLogprobs([logprobs.token_ids[i]], [logprobs.logprobs[i]], [logprobs.top_token_ids[i]],
                         [logprobs.top_logprobs[i]])  # fmt: skip
