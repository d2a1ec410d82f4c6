"""Incremental detokenisation: text deltas that never split a UTF-8 character.

Normal tokens are decoded in a small sliding window (``prefix``/``read`` offsets, as in TGI and
vLLM): a delta is released only once the window decodes to more text than before and does not end
in U+FFFD (an incomplete byte sequence), or once more tokens wait than any character needs (bytes
that never form a character are then released as U+FFFD: the window stays small, so each token
costs the same). The window starts with up to five prompt tokens so that tokenizers that drop a
leading space on a lone token (SentencePiece) still get it right.

Special tokens split the text into segments: with ``skip_special_tokens`` they vanish; otherwise
their literal text is emitted, and with ``spaces_between_special_tokens`` the segments are joined
by one space (vLLM's rule for the slow path), never at the very start of the output.
"""

from __future__ import annotations

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
