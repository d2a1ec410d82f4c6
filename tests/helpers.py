"""Small helpers shared by the API, live and client tests."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded; the final ``[DONE]`` stays a string."""
    events = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def stream_by_choice(events: list[Any], text_of=lambda c: c.get("text", "")) -> dict[int, dict[str, Any]]:
    """Join streamed deltas per choice index; record every finish chunk seen for each choice."""
    assert events and events[-1] == "[DONE]", "a stream must end with [DONE]"
    joined: dict[int, dict[str, Any]] = defaultdict(lambda: {"text": "", "token_ids": [], "finishes": [], "after_finish": 0})
    for event in events[:-1]:
        assert "error" not in event, event
        # one choice per chunk, as OpenAI and vLLM send them (the usage chunk has none)
        assert len(event["choices"]) <= 1, event
        for choice in event["choices"]:
            slot = joined[choice["index"]]
            if slot["finishes"]:
                slot["after_finish"] += 1
            slot["text"] += text_of(choice) or ""
            slot["token_ids"] += choice.get("token_ids") or []
            if choice.get("finish_reason") is not None:
                slot["finishes"].append(choice["finish_reason"])
    return dict(joined)


def chat_delta_text(choice: dict[str, Any]) -> str:
    return choice.get("delta", {}).get("content") or ""


def ok(r) -> dict[str, Any]:
    """A ``requests`` response that must be a 200: its JSON."""
    assert r.status_code == 200, r.text
    return r.json()


def refused(r, param: str) -> dict[str, Any]:
    """A ``requests`` response that must be a 400 in the error envelope naming ``param``: its error."""
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["message"], error
    return error
