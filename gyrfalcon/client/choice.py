"""One choice on the client side: the core's token ids turned into text, and its stop strings.

Incremental detokenisation: text deltas that never split a UTF-8 character. Normal tokens are
decoded in a small sliding window (``prefix``/``read`` offsets, as in TGI and vLLM): a delta is released only once the window decodes to more text than before and does not end
in U+FFFD (an incomplete byte sequence), or once more tokens wait than any character needs (bytes
that never form a character are then released as U+FFFD: the window stays small, so each token
costs the same). The window starts with up to five prompt tokens so that tokenizers that drop a
leading space on a lone token (SentencePiece) still get it right.

Special tokens split the text into segments: with ``skip_special_tokens`` they vanish; otherwise
their literal text is emitted, and with ``spaces_between_special_tokens`` the segments are joined
by one space (vLLM's rule for the slow path), never at the very start of the output.

Stop strings (vLLM semantics): the earliest stop string in a choice's new text ends it, the text
cut before it (or after it with ``include_stop_str_in_output``), ``stop_reason`` the string; only
once ``min_tokens`` tokens exist. They are matched incrementally: each has a Knuth–Morris–Pratt
automaton fed only the new characters, so checking a token costs time linear in its text whatever
the stop strings' length, and the text held back (what could still begin a stop string) is read
off the automata's states. The core knows no text: the client tells it to finish a choice that hit
one.
"""

from __future__ import annotations

import functools
from typing import Any

from gyrfalcon.engine_api.outputs import ChoiceProgress
from gyrfalcon.engine_api.types import CompletionOutput, SamplingParams, TokenLogprobs

_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"
#: tokens held while they do not complete a character: a UTF-8 character is at most 4 bytes, so
#: beyond this the bytes never will (invalid sequences) and are released as U+FFFD — otherwise
#: every new token would re-decode an ever-growing window
_MAX_PENDING = 6


class IncrementalDetokenizer:
    """Turns one choice's generated token ids into text, a delta per token."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        special_ids: frozenset[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.special_ids = special_ids
        self.skip_special_tokens = skip_special_tokens
        self.spaces = spaces_between_special_tokens
        context: list[int] = []
        for token_id in reversed(prompt_token_ids[-_PROMPT_CONTEXT:]):
            if token_id in special_ids:
                break
            context.insert(0, token_id)
        self._ids = context
        self._prefix = 0
        self._read = len(context)
        self._emitted_any = False
        self._separator_due = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _release(self, text: str) -> str:
        if not text:
            return ""
        if self._separator_due:
            self._separator_due = False
            text = " " + text
        self._emitted_any = True
        return text

    def add(self, token_id: int) -> str:
        """Feed one token; return the newly complete text (possibly empty)."""
        if token_id in self.special_ids:
            if self.skip_special_tokens:
                return ""
            pending = self.flush()
            if self.spaces and (self._emitted_any or pending):
                self._separator_due = True
            text = pending + self._release(self._decode([token_id]))
            self._ids, self._prefix, self._read = [], 0, 0
            self._separator_due = self.spaces
            return text
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        complete = len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT)
        if complete or len(self._ids) - self._read > _MAX_PENDING:
            self._prefix, self._read = self._read, len(self._ids)
            return self._release(new_text[len(prefix_text) :])
        return ""

    def flush(self) -> str:
        """Release whatever is held back (an incomplete character decodes as U+FFFD)."""
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix, self._read = self._read, len(self._ids)
        return self._release(new_text[len(prefix_text) :])


class NoText:
    """The detokenizer of a request that asked for token ids only (``detokenize: false``)."""

    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


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


@functools.lru_cache(maxsize=4096)
def _failure(stop: str) -> tuple[int, ...]:
    """KMP prefix function: for each prefix ``stop[:i + 1]``, its longest proper border."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


class _Matcher:
    """One stop string's automaton: ``state`` is the longest prefix of the stop string that ends
    the text fed so far."""

    __slots__ = ("stop", "fail", "state")

    def __init__(self, stop: str) -> None:
        self.stop, self.fail, self.state = stop, _failure(stop), 0

    def step(self, ch: str) -> bool:
        """Feed one character; True when the stop string ends with it."""
        stop, state = self.stop, self.state
        while state and stop[state] != ch:
            state = self.fail[state - 1]
        if stop[state] == ch:
            state += 1
        if state == len(stop):
            self.state = self.fail[state - 1]
            return True
        self.state = state
        return False


class StopStrings:
    """The stop strings of one choice."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.stop = [s for s in params.stop if s]
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self._matchers = [_Matcher(stop) for stop in self.stop]
        self._fed = 0  # characters of the text fed to the automata

    def check_text(self, text: str, num_generated: int) -> tuple[str, int] | None:
        """``(stop_string, cut_length)`` for the earliest-starting stop string that ends in the
        text added since the last call (``text`` only ever grows between calls)."""
        if not self._matchers:
            return None
        counts = num_generated >= self.params.min_tokens
        best: tuple[int, str] | None = None
        for i in range(self._fed, len(text)):
            ch = text[i]
            for matcher in self._matchers:
                if matcher.step(ch) and counts:
                    start = i - len(matcher.stop) + 1
                    if best is None or start < best[0]:
                        best = (start, matcher.stop)
        self._fed = len(text)
        if best is None:
            return None
        position, stop = best
        cut = position + len(stop) if self.params.include_stop_str_in_output else position
        return stop, cut

    def held(self) -> int:
        """How many trailing characters of the text fed so far could still begin a stop string."""
        if self.params.include_stop_str_in_output or not self._matchers:
            return 0
        return max(matcher.state for matcher in self._matchers)

    def holdback(self, text: str) -> int:
        """:meth:`held` for any ``text`` (fresh automata over its tail; linear time)."""
        if not self.stop or self.params.include_stop_str_in_output:
            return 0
        matchers = [_Matcher(stop) for stop in self.stop]
        for ch in text[max(len(text) - self.max_stop_len + 1, 0) :] if self.max_stop_len > 1 else "":
            for matcher in matchers:
                matcher.step(ch)
        return max(matcher.state for matcher in matchers)
