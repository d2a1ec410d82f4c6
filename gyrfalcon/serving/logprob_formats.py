"""Logprob shapes of each endpoint, rendered from the engine's :class:`TokenLogprobs`.

Which alternatives a position lists (``top`` below is what the engine gathered for it, ranked):

- top-k mode (``logprobs``/``top_logprobs`` count ``k``): completions and generate list the ``k``
  most likely tokens plus the position's own token (OpenAI's legacy "up to logprobs + 1" rule,
  vLLM's dicts); chat lists exactly the ``k`` most likely (OpenAI chat);
- ``logprob_token_ids`` mode (generated positions only): every endpoint lists exactly the sampled
  token plus every requested id — the engine already gathered precisely that set;
- prompt positions (echo, ``prompt_logprobs``): the prompt token plus the ``k`` most likely; the
  first prompt position has no logprob (``null``).

Token strings are each token decoded alone (``"token_id:N"`` with ``return_tokens_as_token_ids``);
chat ``bytes`` are the token's raw bytes from the tokenizer's byte mapping (a byte-level token may
be part of a UTF-8 character). Values are finite: the engine clamps ``-inf`` to -9999.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gyrfalcon.engine_api.interface import Engine
from gyrfalcon.engine_api.types import TokenLogprobs


@dataclass(frozen=True)
class Listing:
    """How many alternatives a position shows: ``count`` (None: all gathered) and whether the
    position's own token is added when it is not among them."""

    count: int | None
    include_own: bool


class TokenText:
    """Token strings and bytes for one response, fetched from the engine in batches and cached."""

    def __init__(self, engine: Engine | None, as_token_ids: bool) -> None:
        self.engine = engine
        self.as_token_ids = as_token_ids
        self._strings: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def _all_ids(self, logprobs: TokenLogprobs) -> list[int]:
        ids = set(logprobs.token_ids)
        for top in logprobs.top_token_ids:
            ids.update(top)
        return sorted(ids)

    def load(self, logprobs: TokenLogprobs, with_bytes: bool = False) -> None:
        """Fetch the strings (and bytes) of every id that ``logprobs`` mentions, in one call each."""
        ids = self._all_ids(logprobs)
        missing = [t for t in ids if t not in self._strings]
        if missing:
            if self.as_token_ids or self.engine is None:
                strings = [f"token_id:{t}" for t in missing]
            else:
                strings = self.engine.token_strings(missing)
            self._strings.update(zip(missing, strings))
        if with_bytes:
            missing = [t for t in ids if t not in self._bytes]
            if missing:
                raw = self.engine.token_bytes(missing) if self.engine is not None else [b""] * len(missing)
                self._bytes.update((t, list(b)) for t, b in zip(missing, raw))

    def string(self, token_id: int) -> str:
        return self._strings[token_id]

    def raw(self, token_id: int) -> list[int]:
        return self._bytes[token_id]


def alternatives(logprobs: TokenLogprobs, position: int, listing: Listing) -> list[tuple[int, float]]:
    """``(token_id, logprob)`` pairs a position lists, in rank order, without duplicates."""
    top = list(zip(logprobs.top_token_ids[position], logprobs.top_logprobs[position]))
    if listing.count is not None:
        top = top[: listing.count]
    own = logprobs.token_ids[position]
    value = logprobs.logprobs[position]
    if listing.include_own and value is not None and all(t != own for t, _ in top):
        top.append((own, value))
    return top


def _keyed_by_text(text: TokenText, pairs: list[tuple[int, float]]) -> dict[str, float]:
    """``{token text: logprob}``; a token whose text is already a key (two ids that decode alike,
    such as partial UTF-8 bytes) is keyed ``"token_id:N"``, so no listed id is ever lost."""
    keyed: dict[str, float] = {}
    for token_id, value in pairs:
        key = text.string(token_id)
        keyed[f"token_id:{token_id}" if key in keyed else key] = value
    return keyed


def completion_logprobs(
    text: TokenText, parts: list[tuple[TokenLogprobs, Listing]], offset: int
) -> tuple[dict[str, Any], int]:
    """The completions ``logprobs`` object over consecutive parts (echoed prompt, then generated).

    ``offset`` is the ``text_offset`` of the first token; each next offset adds the previous
    token string's length (vLLM's rule, so streamed deltas continue where the last one ended).
    Returns the object and the offset after the last token.
    """
    body: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for logprobs, listing in parts:
        text.load(logprobs)
        for p, token_id in enumerate(logprobs.token_ids):
            token = text.string(token_id)
            body["text_offset"].append(offset)
            body["tokens"].append(token)
            value = logprobs.logprobs[p]
            body["token_logprobs"].append(value)
            if value is None:
                body["top_logprobs"].append(None)
            else:
                body["top_logprobs"].append(_keyed_by_text(text, alternatives(logprobs, p, listing)))
            offset += len(token)
    return body, offset


def chat_logprobs(text: TokenText, logprobs: TokenLogprobs, listing: Listing) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{content: [{token, logprob, bytes, top_logprobs}]}``."""
    text.load(logprobs, with_bytes=True)
    content = []
    for p, token_id in enumerate(logprobs.token_ids):
        content.append(
            {
                "token": text.string(token_id),
                "logprob": logprobs.logprobs[p],
                "bytes": text.raw(token_id),
                "top_logprobs": [
                    {"token": text.string(t), "logprob": v, "bytes": text.raw(t)}
                    for t, v in alternatives(logprobs, p, listing)
                ],
            }
        )
    return {"content": content}


def generate_logprobs(logprobs: TokenLogprobs, listing: Listing) -> dict[str, Any]:
    """The generate ``logprobs`` object: ``{content: [{token: "token_id:N", logprob, top_logprobs}]}``."""
    content = []
    for p, token_id in enumerate(logprobs.token_ids):
        value = logprobs.logprobs[p]
        top = [] if value is None else alternatives(logprobs, p, listing)
        content.append(
            {
                "token": f"token_id:{token_id}",
                "logprob": value,
                "top_logprobs": [{"token": f"token_id:{t}", "logprob": v} for t, v in top],
            }
        )
    return {"content": content}


def vllm_prompt_logprobs(
    text: TokenText, logprobs: TokenLogprobs, count: int, decoded: bool = True
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` list: ``null`` for the first position, then by token id the
    prompt token and the ``count`` most likely, each ``{"logprob", "rank", "decoded_token"}``
    (``decoded_token`` null when ``decoded`` is False; ``rank`` null where the engine gave none)."""
    plain = TokenText(text.engine, as_token_ids=False)
    if decoded:
        plain.load(logprobs)
    out: list[dict[str, Any] | None] = []
    for p, own in enumerate(logprobs.token_ids):
        value = logprobs.logprobs[p]
        if value is None:
            out.append(None)
            continue
        listed = [(own, value), *alternatives(logprobs, p, Listing(count, include_own=False))]
        out.append({
            str(t): {"logprob": v, "rank": logprobs.rank(p, t), "decoded_token": plain.string(t) if decoded else None}
            for t, v in listed
        })  # fmt: skip
    return out
