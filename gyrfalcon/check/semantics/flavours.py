"""The two text endpoints seen through one interface, so a promise both make is checked once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gyrfalcon.check.registry import Broken, check

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@dataclass(frozen=True)
class Flavour:
    endpoint: str  # the --only group
    path: str
    object: str
    chunk_object: str

    def body(self, prompt: str = PROMPT, **fields: Any) -> dict[str, Any]:
        if self.endpoint == "completions":
            return {"prompt": prompt, **fields}
        return {"messages": [{"role": "user", "content": prompt}], **fields}

    def logprobs(self, k: int) -> dict[str, Any]:
        """The request fields asking for ``k`` top log-probabilities per position."""
        return {"logprobs": k} if self.endpoint == "completions" else {"logprobs": True, "top_logprobs": k}

    def text(self, choice: dict[str, Any]) -> str:
        text = choice.get("text") if self.endpoint == "completions" else (choice.get("message") or {}).get("content")
        if not isinstance(text, str):
            raise Broken(f"choice {choice.get('index')} has no text: {str(choice)[:200]}")
        return text

    def delta_text(self, choice: dict[str, Any]) -> str:
        if self.endpoint == "completions":
            return choice.get("text") or ""
        return (choice.get("delta") or {}).get("content") or ""

    def positions(self, choice: dict[str, Any]) -> list[tuple[str, float, dict[str, float] | None]]:
        """Per generated position of ``choice``: (token, logprob, top logprobs by token)."""
        logprobs = choice.get("logprobs")
        if not isinstance(logprobs, dict):
            raise Broken(f"choice {choice.get('index')} carries no logprobs object: {str(logprobs)[:200]}")
        if self.endpoint == "completions":
            tokens, values, tops = (logprobs.get(k) for k in ("tokens", "token_logprobs", "top_logprobs"))
            if not (isinstance(tokens, list) and isinstance(values, list) and isinstance(tops, list)):
                raise Broken(f"logprobs without the tokens, token_logprobs and top_logprobs lists: {str(logprobs)[:200]}")
            if not len(tokens) == len(values) == len(tops):
                raise Broken(f"logprobs lists of different lengths: {len(tokens)}, {len(values)}, {len(tops)}")
            return list(zip(tokens, values, tops))
        content = logprobs.get("content")
        if not isinstance(content, list):
            raise Broken(f"chat logprobs without a content list: {str(logprobs)[:200]}")
        return [(token_key(e), e["logprob"], {token_key(t): t["logprob"] for t in e.get("top_logprobs") or []})
                for e in content]  # fmt: skip


def token_key(entry: dict[str, Any]) -> str:
    """A chat logprob entry's token, told apart by its bytes where its text is a partial character:
    two tokens holding different halves of one character both read "\ufffd" and are not one token."""
    token, raw = entry["token"], entry.get("bytes")
    if "\ufffd" in token and isinstance(raw, list):
        return f"{token}<{bytes(b & 0xFF for b in raw if isinstance(b, int)).hex()}>"
    return token


COMPLETIONS = Flavour("completions", "/v1/completions", "text_completion", "text_completion")
CHAT = Flavour("chat", "/v1/chat/completions", "chat.completion", "chat.completion.chunk")
FLAVOURS = (COMPLETIONS, CHAT)


def on_both(*features: str):
    """Register ``fn(target, flavour)`` as a check of completions and one of chat."""

    def register(fn):
        for flavour in FLAVOURS:
            check(flavour.endpoint, *features, name=fn.__name__, params=None)(
                _bound(fn, flavour))
        return fn

    return register


def _bound(fn, flavour: Flavour):
    def run(target):
        return fn(target, flavour)

    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run


def expect(condition: Any, message: str) -> None:
    if not condition:
        raise Broken(message)


def indices(choices: list[dict[str, Any]]) -> list[int]:
    return sorted(c.get("index") for c in choices)


def by_index(reply: dict[str, Any], n: int) -> dict[int, dict[str, Any]]:
    """The choices of a reply to a request for ``n``, by index, insisting on exactly ``0..n-1``."""
    choices = reply.get("choices")
    expect(isinstance(choices, list), f"no choices list: {str(reply)[:200]}")
    expect(indices(choices) == list(range(n)), f"n={n} gave choice indices {indices(choices)}")
    return {c["index"]: c for c in choices}
