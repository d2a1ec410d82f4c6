"""Stop strings (vLLM semantics): the earliest stop string in a choice's new text ends it, the text
cut before it (or after it with ``include_stop_str_in_output``), ``stop_reason`` the string; only
once ``min_tokens`` tokens exist.

Stop strings are matched incrementally: each has a Knuth–Morris–Pratt automaton fed only the new
characters, so checking a token costs time linear in its text whatever the stop strings' length,
and the text held back (what could still begin a stop string) is read off the automata's states.
"""

from __future__ import annotations

import functools

from gyrfalcon.engine_api.types import SamplingParams


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
