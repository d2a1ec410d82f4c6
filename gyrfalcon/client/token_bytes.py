"""The raw bytes of single tokens, for the ``bytes`` of chat logprob entries.

A byte-level BPE token may hold part of a UTF-8 character (``"é"`` is two tokens in many
vocabularies), so decoding it alone gives U+FFFD and its UTF-8 would be wrong. This module reads
the tokenizer's own byte mapping instead:

- byte-level BPE (GPT-2, Llama 3, SmolLM2, …): each character of the token's vocabulary string
  stands for one byte (the inverse of GPT-2's ``bytes_to_unicode``);
- SentencePiece with byte fallback: ``<0xNN>`` pieces are that byte, ``▁`` is a space;
- added and special tokens, and any other tokenizer: the UTF-8 of the token's decoded text.
"""

from __future__ import annotations

import functools
import re
from typing import Any

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet back to bytes (inverse of ``bytes_to_unicode``)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


def _decoder_kind(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    text = repr(decoder) if decoder is not None else ""
    if text.startswith("ByteLevel"):
        return "byte_level"
    if "ByteFallback" in text:
        return "byte_fallback"
    return "text"


class TokenBytes:
    """Maps token ids to their raw bytes with a tokenizer's own byte mapping (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kind = _decoder_kind(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.added = frozenset(int(i) for i in added) | frozenset(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, bytes] = {}

    def _text_bytes(self, token_id: int) -> bytes:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text.encode("utf-8")

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added or self.kind == "text":
            return self._text_bytes(token_id)
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return self._text_bytes(token_id)
        if self.kind == "byte_level":
            table = byte_level_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return self._text_bytes(token_id)
        match = _BYTE_PIECE.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("▁", " ").encode("utf-8")

    def __call__(self, token_ids: list[int]) -> list[bytes]:
        """The bytes of each token, in order."""
        out = []
        for token_id in token_ids:
            value = self._cache.get(token_id)
            if value is None:
                value = self._cache[token_id] = self._bytes(int(token_id))
            out.append(value)
        return out
