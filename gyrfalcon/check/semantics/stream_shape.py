"""What every OpenAI-shaped event stream must look like, read once into per-choice pieces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gyrfalcon.check.registry import Broken
from gyrfalcon.check.target import Reply


@dataclass
class Stream:
    chunks: list[dict[str, Any]]
    #: index -> concatenated text (or, on generate, token ids)
    text: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    #: index -> the finish reasons its chunks carried (one is the promise)
    finishes: dict[int, list[str]] = field(default_factory=dict)
    #: chunks whose usage is set
    usage_chunks: list[int] = field(default_factory=list)


def read_stream(reply: Reply, delta_text=lambda choice: choice.get("text") or "") -> Stream:
    """Parse a stream, insisting on the framing every client relies on: JSON events, one
    ``[DONE]`` last, one id, at most one choice per chunk, nothing for a choice after its finish."""
    events = reply.events
    if not events or events[-1] != "[DONE]":
        raise Broken(f"the stream does not end with data: [DONE] (last event: {str(events[-1:])[:200]})")
    if "[DONE]" in events[:-1]:
        raise Broken("data: [DONE] before the end of the stream")
    chunks = events[:-1]
    for chunk in chunks:
        if not isinstance(chunk, dict):
            raise Broken(f"a stream event that is not a JSON object: {str(chunk)[:200]}")
        if "error" in chunk:
            raise Broken(f"the stream carries an error event: {str(chunk['error'])[:200]}")
    ids = {chunk.get("id", chunk.get("request_id")) for chunk in chunks}
    if len(ids) > 1:
        raise Broken(f"one stream, {len(ids)} different ids: {sorted(map(str, ids))[:4]}")
    stream = Stream(chunks)
    for i, chunk in enumerate(chunks):
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise Broken(f"chunk {i} has no choices list: {str(chunk)[:200]}")
        if len(choices) > 1:
            raise Broken(f"chunk {i} carries {len(choices)} choices (one choice per chunk)")
        if chunk.get("usage"):
            stream.usage_chunks.append(i)
        for choice in choices:
            index = choice.get("index")
            if not isinstance(index, int):
                raise Broken(f"chunk {i}: a choice without an integer index: {str(choice)[:200]}")
            piece, ids_piece = delta_text(choice), choice.get("token_ids") or []
            if stream.finishes.get(index) and (piece or ids_piece):
                raise Broken(f"chunk {i}: choice {index} goes on after its finish_reason")
            stream.text[index] = stream.text.get(index, "") + piece
            stream.token_ids.setdefault(index, []).extend(ids_piece)
            stream.finishes.setdefault(index, [])
            if choice.get("finish_reason") is not None:
                stream.finishes[index].append(choice["finish_reason"])
    return stream


def expect_choices(stream: Stream, n: int) -> None:
    """Choices ``0..n-1``, each finished exactly once."""
    if sorted(stream.finishes) != list(range(n)):
        raise Broken(f"n={n}: the stream carries choice indices {sorted(stream.finishes)}, not 0..{n - 1}")
    for index, finishes in stream.finishes.items():
        if len(finishes) != 1:
            raise Broken(f"choice {index} carries {len(finishes)} finish reasons ({finishes}), not one")
