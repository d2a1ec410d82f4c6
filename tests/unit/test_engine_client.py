"""The engine client: text is made from the core's token ids on the consumer's side, and a stop
string found there ends the choice in the core too (its blocks freed, no more tokens drawn)."""

from __future__ import annotations

import queue

from gyrfalcon.engine_api.types import OutputKind
from tests.unit.test_batching import PROMPTS, alone, request, run, stepped  # noqa: F401 - fixture


def test_a_stop_string_ends_the_choice_in_the_core_too(stepped):
    engine = stepped()
    asks = dict(n=2, temperature=1.0, seed=21, max_tokens=30, ignore_eos=True)
    (choices,) = alone(engine, [request(PROMPTS[1], **asks)])
    text = engine.detokenize(choices[0], skip_special_tokens=True)  # as the output's text is decoded
    stop = engine.detokenize(choices[0][4:7], skip_special_tokens=True)  # text choice 0 reaches after a few tokens
    assert stop and stop in text
    before = engine.stats()["generation_tokens"]
    stream = engine.submit(request(PROMPTS[1], kind=OutputKind.FINAL_ONLY, stop=[stop], **asks))
    final = None
    while engine.core.batcher.step() or final is None:  # the reader (client side) keeps up with every step
        try:
            final = final or stream.get(timeout=0)
        except queue.Empty:
            pass
    first = final.outputs[0]
    assert first.finish_reason == "stop" and first.stop_reason == stop
    assert first.text == text[: text.index(stop)] and len(first.token_ids) < 30  # (bytes may complete later)
    generated = engine.stats()["generation_tokens"] - before
    other = final.outputs[1]
    # the core drew choice 0's tokens only until the client told it: at most one step more
    assert generated <= len(first.token_ids) + 1 + len(other.token_ids)
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
