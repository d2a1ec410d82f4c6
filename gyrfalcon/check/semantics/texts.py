"""Promises completions and chat both make: all ``n`` choices, streamed as they are answered,
reproducible seeds, greedy decoding that is greedy, usage, nulls, stop strings, logprobs."""

from __future__ import annotations

import math

from gyrfalcon.check.registry import Inconclusive
from gyrfalcon.check.semantics.flavours import PROMPT, Flavour, by_index, expect, indices, on_both
from gyrfalcon.check.semantics.stream_shape import expect_choices, read_stream

TOLERANCE = 0.02  # log-probabilities of one server, batched differently (bf16 on a GPU)
#: one request asked twice (streamed and not): a server that reuses the first one's cached prompt
#: computes the second's positions in other shapes (llama.cpp, Q4_1 on a CPU: 0.055 measured). The
#: tokens must still be the same, position by position.
REPEAT_TOLERANCE = 0.1


@on_both()
def basic(target, f: Flavour):
    """A plain request: the object name, one choice at index 0 with text and a finish reason, and
    usage whose total is prompt plus completion."""
    r = target.ok(f.path, f.body(max_tokens=8)).json
    expect(r.get("object") == f.object, f"object is {r.get('object')!r}, not {f.object!r}")
    expect(isinstance(r.get("id"), str) and isinstance(r.get("created"), int), "id (string) or created (integer) missing")
    expect(indices(r["choices"]) == [0], f"one choice asked, indices {indices(r['choices'])}")
    f.text(r["choices"][0])
    expect(r["choices"][0].get("finish_reason") in ("stop", "length"), f"finish_reason {r['choices'][0].get('finish_reason')!r}")
    u = r.get("usage") or {}
    expect(u.get("total_tokens") == u.get("prompt_tokens", 0) + u.get("completion_tokens", 0) and u.get("prompt_tokens", 0) > 0,
           f"usage does not add up: {u}")  # fmt: skip


@on_both()
def max_tokens_respected(target, f: Flavour):
    """max_tokens bounds every choice; a choice cut by it says finish_reason "length"."""
    r = target.ok(f.path, f.body(max_tokens=3, temperature=1.0, seed=3)).json
    u = r["usage"]
    expect(u["completion_tokens"] <= 3, f"max_tokens 3 gave {u['completion_tokens']} completion tokens")
    if u["completion_tokens"] == 3:
        expect(r["choices"][0]["finish_reason"] == "length", f"3 of 3 tokens and finish_reason {r['choices'][0]['finish_reason']!r}")


@on_both("n")
def n_choices(target, f: Flavour):
    """n = 4: four choices, indices 0..3, each with its own finish reason."""
    r = target.ok(f.path, f.body(n=4, max_tokens=6, temperature=1.0)).json
    for c in by_index(r, 4).values():
        f.text(c)
        expect(c.get("finish_reason") in ("stop", "length"), f"choice {c['index']}: finish_reason {c.get('finish_reason')!r}")


#: four independent samples all equal to one answer are expected (not a copied sample) when that
#: answer's probability cubed is at least this
ONE_ANSWER_CHANCE = 1e-4


@on_both("n")
def n_choices_are_samples_of_their_own(target, f: Flavour):
    """n = 4 sampled at temperature 1.5: the choices are separate samples, not copies of one. Four
    equal answers are a failure only when the server's own logprobs make that answer unlikely (a
    model that allows one answer gives four equal samples: inconclusive)."""
    body = f.body(n=4, max_tokens=16, temperature=1.5)
    texts = [f.text(c) for c in by_index(target.ok(f.path, body).json, 4).values()]
    if len(set(texts)) > 1:
        return
    reply = target.post(f.path, {"model": target.model, **body, **f.logprobs(0)})
    choices = by_index(reply.json, 4) if reply.status == 200 else None
    if choices is None or not all(isinstance(c.get("logprobs"), dict) for c in choices.values()):
        raise Inconclusive(f"four sampled choices, all {texts[0]!r}, and no logprobs to tell a copied sample from a "
                           "model that allows one answer")  # fmt: skip
    texts = [f.text(c) for c in choices.values()]
    if len(set(texts)) > 1:
        return
    logprob = sum(lp for _, lp, _ in f.positions(choices[0]) if lp is not None)
    chance = math.exp(3 * logprob)
    expect(chance >= ONE_ANSWER_CHANCE, f"four sampled choices, all {texts[0]!r}, an answer the server's own logprobs "
           f"give probability {math.exp(logprob):.2g}: copies of one sample, not four samples")  # fmt: skip
    raise Inconclusive(f"four sampled choices, all {texts[0]!r}, which the model gives probability "
                       f"{math.exp(logprob):.2g}: one answer is what this model says")  # fmt: skip


@on_both("n", "logprobs")
def usage_counts_every_choice(target, f: Flavour):
    """With n = 3, usage.completion_tokens is the sum over the choices (counted by their logprobs)."""
    r = target.ok(f.path, f.body(n=3, max_tokens=5, temperature=1.0, **f.logprobs(0))).json
    counted = sum(len(f.positions(c)) for c in by_index(r, 3).values())
    expect(r["usage"]["completion_tokens"] == counted,
           f"usage.completion_tokens {r['usage']['completion_tokens']}, the choices' positions {counted}")  # fmt: skip


@on_both("seed")
def seed_reproducible(target, f: Flavour):
    """The same seeded, sampled request twice (n = 2): the same choices."""
    body = f.body(n=2, max_tokens=8, temperature=1.0, seed=1234)
    a, b = ({i: f.text(c) for i, c in by_index(target.ok(f.path, body).json, 2).items()} for _ in range(2))
    expect(a == b, f"seed 1234 gave {a} then {b}")


@on_both()
def greedy_deterministic(target, f: Flavour):
    """temperature 0 twice: the same text."""
    body = f.body(max_tokens=8, temperature=0.0)
    a, b = (f.text(target.ok(f.path, body).json["choices"][0]) for _ in range(2))
    expect(a == b, f"greedy gave {a!r} then {b!r}")


@on_both("logprobs")
def greedy_picks_the_most_likely(target, f: Flavour):
    """temperature 0 with 3 top logprobs: at every position the chosen token's logprob is the top one."""
    r = target.ok(f.path, f.body(max_tokens=6, temperature=0.0, **f.logprobs(3))).json
    for i, (token, logprob, top) in enumerate(f.positions(r["choices"][0])):
        expect(top, f"position {i}: no top logprobs")
        best = max(top.values())
        expect(logprob is not None and logprob >= best - TOLERANCE,
               f"position {i}: greedy chose {token!r} (logprob {logprob}) below the top one {best}")  # fmt: skip


@on_both("logprobs")
def logprobs_shape(target, f: Flavour):
    """logprobs with k = 2: one entry per generated token, values ≤ 0, 2 to 3 top entries (the k
    most likely and the chosen one), the chosen token's value the same in both places. (Completions'
    top logprobs are an object keyed by text: two tokens that are halves of characters both read
    "\ufffd" there and take one key.)"""
    r = target.ok(f.path, f.body(max_tokens=6, temperature=1.0, seed=5, **f.logprobs(2))).json
    positions = f.positions(r["choices"][0])
    expect(len(positions) == r["usage"]["completion_tokens"],
           f"{len(positions)} logprob positions for {r['usage']['completion_tokens']} completion tokens")  # fmt: skip
    for i, (token, logprob, top) in enumerate(positions):
        expect(isinstance(logprob, (int, float)) and logprob <= 1e-4, f"position {i}: logprob {logprob}")
        collided = f.endpoint == "completions" and any("\ufffd" in t for t in top or {})
        expect(top is not None and (2 if not collided else 1) <= len(top) <= 3, f"position {i}: {len(top or {})} top logprobs for k=2")
        expect(all(v <= 1e-4 for v in top.values()), f"position {i}: a top logprob above 0: {top}")
        if token in top:
            expect(math.isclose(top[token], logprob, abs_tol=1e-3), f"position {i}: {token!r} is {logprob} and {top[token]}")


#: prompts whose greedy answers the stop-string check tries in turn, before seeded samples
STOP_PROMPTS = (PROMPT, "Write one sentence about the sea.", "List three animals, then three colours:")
STOP_SEEDS = (101, 202, 303)


def _stop_string(text: str) -> str | None:
    """Two characters of ``text`` that first occur past its start (so the cut answer is not empty),
    beginning with a character seen nowhere before them: None when the text has none."""
    start = next((i for i in range(1, len(text) - 1) if not text[i].isspace() and text[i] not in text[:i]), None)
    return None if start is None else text[start:start + 2]


def _stop_candidate(target, f: Flavour) -> tuple[dict, str, str]:
    """A request, its answer and a stop string chosen from it: greedy answers to a few prompts, then
    seeded samples (each asked twice: only a reproducible answer can be cut and compared);
    :class:`Inconclusive` when no answer offers a stop string."""
    seen = []
    bodies = [f.body(prompt, max_tokens=16, temperature=0.0) for prompt in STOP_PROMPTS]
    bodies += [f.body(PROMPT, max_tokens=16, temperature=1.0, seed=seed) for seed in STOP_SEEDS]
    for body in bodies:
        text = f.text(target.ok(f.path, body).json["choices"][0])
        seen.append(text)
        stop = _stop_string(text)
        if stop is not None and (body["temperature"] == 0.0 or f.text(target.ok(f.path, body).json["choices"][0]) == text):
            return body, text, stop
    raise Inconclusive(f"no stop string can be chosen from the model's answers {seen}")


@on_both("stop")
def stop_string_cuts(target, f: Flavour):
    """A stop string taken from the model's answer: the answer ends just before it, finish "stop",
    streamed and not (inconclusive when no answer of the model offers one)."""
    body, text, stop = _stop_candidate(target, f)
    r = target.ok(f.path, {**body, "stop": [stop]}).json["choices"][0]
    expect(f.text(r) == text[: text.index(stop)] and r["finish_reason"] == "stop",
           f"stop {stop!r}: text {f.text(r)!r} finish {r['finish_reason']!r}; without it {text!r}")  # fmt: skip
    stream = read_stream(target.ok(f.path, {**body, "stop": [stop], "stream": True}), f.delta_text)
    expect(stream.text.get(0) == f.text(r) and stream.finishes.get(0) == ["stop"],
           f"stop {stop!r} streamed: {stream.text.get(0)!r} {stream.finishes.get(0)}, not streamed {f.text(r)!r}")  # fmt: skip


@on_both("stream")
def stream_framing(target, f: Flavour):
    """stream true: an event stream of JSON chunks with one id, the chunk object name, one choice per
    chunk, data: [DONE] last, and no usage unless asked for."""
    reply = target.ok(f.path, f.body(max_tokens=6, stream=True))
    stream = read_stream(reply, f.delta_text)
    expect(all(c.get("object") == f.chunk_object for c in stream.chunks),
           f"chunk objects {sorted({str(c.get('object')) for c in stream.chunks})}, not {f.chunk_object!r}")  # fmt: skip
    expect_choices(stream, 1)
    expect(not stream.usage_chunks, "a usage chunk nobody asked for (stream_options.include_usage unset)")


@on_both("stream", "n")
def stream_n_choices(target, f: Flavour):
    """stream with n = 3: every choice 0..2 streamed, one finish reason each."""
    stream = read_stream(target.ok(f.path, f.body(n=3, max_tokens=6, temperature=1.0, stream=True)), f.delta_text)
    expect_choices(stream, 3)


@on_both("stream", "n", "seed")
def stream_equals_non_stream(target, f: Flavour):
    """The same seeded n = 2 request streamed and not: the same text for every choice."""
    body = f.body(n=2, max_tokens=8, temperature=1.0, seed=77)
    whole = {i: f.text(c) for i, c in by_index(target.ok(f.path, body).json, 2).items()}
    stream = read_stream(target.ok(f.path, {**body, "stream": True}), f.delta_text)
    expect_choices(stream, 2)
    expect(stream.text == whole, f"streamed {stream.text} but not streamed {whole}")


@on_both("stream", "stream_options", "n", "seed")
def stream_usage_chunk(target, f: Flavour):
    """stream_options.include_usage: one last chunk with usage and no choices, the same usage as the
    same seeded n = 2 request not streamed."""
    body = f.body(max_tokens=6, n=2, temperature=1.0, seed=21)
    usage = target.ok(f.path, body).json["usage"]
    stream = read_stream(target.ok(f.path, {**body, "stream": True, "stream_options": {"include_usage": True}}), f.delta_text)
    last = len(stream.chunks) - 1
    expect(stream.usage_chunks == [last], f"usage in chunks {stream.usage_chunks} of 0..{last}, not in the last alone")
    expect(stream.chunks[last]["choices"] == [], "the usage chunk carries choices")
    got = {k: stream.chunks[last]["usage"].get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    want = {k: usage.get(k) for k in got}
    expect(got == want, f"streamed usage {got}, not streamed {want}")


@on_both("stream", "logprobs")
def stream_logprobs(target, f: Flavour):
    """Streamed logprobs: as many positions as completion tokens, the same tokens as not streamed and
    the same values (within the numerics of a request computed twice)."""
    body = f.body(max_tokens=6, temperature=0.0, **f.logprobs(1))
    whole = f.positions(target.ok(f.path, body).json["choices"][0])
    stream = read_stream(target.ok(f.path, {**body, "stream": True}), f.delta_text)
    streamed = [p for chunk in stream.chunks for c in chunk["choices"] if c.get("logprobs") for p in f.positions(c)]
    expect([t for t, _, _ in streamed] == [t for t, _, _ in whole],
           f"streamed tokens {[t for t, _, _ in streamed]}, not streamed {[t for t, _, _ in whole]}")  # fmt: skip
    for i, ((_, a, _), (_, b, _)) in enumerate(zip(streamed, whole)):
        expect(math.isclose(a, b, abs_tol=REPEAT_TOLERANCE), f"position {i}: streamed logprob {a}, not streamed {b}")


#: optional fields an SDK or a framework sends as null meaning "not set"
NULLS_BOTH = ("temperature", "top_p", "n", "stream", "stop", "presence_penalty", "frequency_penalty",
              "logit_bias", "seed", "user", "stream_options", "logprobs")  # fmt: skip
NULLS = {"completions": NULLS_BOTH + ("echo",),
         "chat": NULLS_BOTH + ("top_logprobs", "max_completion_tokens", "tools", "tool_choice", "response_format")}


@on_both("nulls")
def nulls_mean_not_set(target, f: Flavour):
    """Every optional field an SDK may send as null is accepted as "not set"."""
    r = target.ok(f.path, {**f.body(), **dict.fromkeys(NULLS[f.endpoint]), "max_tokens": 4}).json
    expect(indices(r["choices"]) == [0], f"one choice expected, got indices {indices(r['choices'])}")
    f.text(r["choices"][0])
