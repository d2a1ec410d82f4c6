"""Promises of batch chat (/v1/chat/completions/batch): one choice per conversation, each the
answer that conversation gets alone."""

from __future__ import annotations

from gyrfalcon.check.registry import check
from gyrfalcon.check.semantics.flavours import CHAT, expect, indices
from gyrfalcon.check.target import refused

PATH = "/v1/chat/completions/batch"
CONVERSATIONS = [[{"role": "user", "content": text}] for text in ("Hello", "Count to five", "Name a fruit")]


@check("batch")
def one_choice_per_conversation(target):
    """Three conversations: three choices, index = conversation index, usage summed over them."""
    r = target.ok(PATH, {"messages": CONVERSATIONS, "max_tokens": 4}).json
    expect(indices(r["choices"]) == [0, 1, 2], f"3 conversations gave indices {indices(r['choices'])}")
    u = r["usage"]
    expect(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], f"usage does not add up: {u}")


@check("batch")
def each_answer_as_alone(target):
    """Greedy: each conversation's answer in the batch is the one it gets alone on chat."""
    batch = {c["index"]: CHAT.text(c) for c in target.ok(PATH, {"messages": CONVERSATIONS, "max_tokens": 6, "temperature": 0.0}).json["choices"]}
    alone = {i: CHAT.text(target.ok(CHAT.path, {"messages": m, "max_tokens": 6, "temperature": 0.0}).json["choices"][0])
             for i, m in enumerate(CONVERSATIONS)}  # fmt: skip
    expect(batch == alone, f"in the batch {batch}, alone {alone}")


@check("batch")
def streaming_refused(target):
    """Batch chat does not stream: stream true is a 400 naming stream, not a silent JSON answer."""
    refused(target.post(PATH, {"model": target.model, "messages": CONVERSATIONS, "stream": True}), "stream")
