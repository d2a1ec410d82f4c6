"""Promises of /v1/completions alone: several prompts, echo with the prompt's logprobs at their
positions, and the vLLM extensions (token ids in and out, prompt_logprobs, logprob_token_ids)."""

from __future__ import annotations

import math

from gyrfalcon.check.registry import check
from gyrfalcon.check.semantics.flavours import COMPLETIONS as F
from gyrfalcon.check.semantics.flavours import by_index, expect, indices
from gyrfalcon.check.semantics.ids import server_ids
from gyrfalcon.check.semantics.stream_shape import expect_choices, read_stream
from gyrfalcon.check.semantics.texts import TOLERANCE

PATH = F.path


def _tops_agree(a: dict[str, float], b: dict[str, float]) -> bool:
    """Two top-logprob maps of one position: the same values for the tokens both list, and the
    same most likely token (or a tie for it)."""
    shared = set(a) & set(b)
    same_best = max(a, key=a.get) == max(b, key=b.get) or math.isclose(max(a.values()), max(b.values()), abs_tol=TOLERANCE)
    return same_best and bool(shared) and all(math.isclose(a[t], b[t], abs_tol=TOLERANCE) for t in shared)


@check("completions", "n", "multiple_prompts")
def several_prompts_with_n(target):
    """Two prompts with n = 2: four choices, indices 0..3 (prompt i's choices at i·n .. i·n+n-1)."""
    r = target.ok(PATH, {"prompt": ["Hello there", "One two three"], "n": 2, "max_tokens": 4, "temperature": 1.0}).json
    expect(indices(r["choices"]) == [0, 1, 2, 3], f"2 prompts × n=2 gave indices {indices(r['choices'])}")


@check("completions", "token_prompts")
def token_id_prompt(target):
    """A prompt given as token ids is taken as those tokens: usage.prompt_tokens is their count."""
    prompt = server_ids(target).prompt
    r = target.ok(PATH, {"prompt": prompt, "max_tokens": 3}).json
    expect(r["usage"]["prompt_tokens"] == len(prompt),
           f"{len(prompt)} prompt ids counted as {r['usage']['prompt_tokens']} prompt tokens")  # fmt: skip


def _misplaced(text: str, tokens: list[str], offsets: list[int]) -> str | None:
    """The first token whose offset does not hold it in ``text``, described; None when all do."""
    for token, offset in zip(tokens, offsets):
        if "\ufffd" not in token and text[offset:offset + len(token)] != token:  # a partial character has no text
            return f"text_offset {offset} holds {text[offset:offset + len(token)]!r}, not the token {token!r}"
    return None


@check("completions", "logprobs", params=[("generated", False), ("echo", True)])
def text_offsets_point_into_the_text(target, echo):
    """logprobs' text_offset: each token's offset in the choice's text (the prompt's included with
    echo), where that token's text is found. Without echo, offsets counted from the prompt's start
    (OpenAI's legacy convention, llama.cpp's) count as well as from the text's (vLLM's)."""
    prompt = "Hello world, said the"
    r = target.ok(PATH, {"prompt": prompt, "max_tokens": 6, "temperature": 0.0, "logprobs": 0, "echo": echo}).json
    choice = r["choices"][0]
    text, offsets = F.text(choice), choice["logprobs"].get("text_offset")
    tokens = [token for token, _, _ in F.positions(choice)]
    expect(isinstance(offsets, list) and len(offsets) == len(tokens), f"text_offset {offsets} for {len(tokens)} tokens")
    expect(offsets == sorted(offsets), f"text_offset goes backwards: {offsets}")
    problem = _misplaced(text, tokens, offsets)
    if problem is not None and not echo and _misplaced(prompt + text, tokens, offsets) is None:
        return
    expect(problem is None, f"{problem} (text {text!r}, offsets {offsets})")


@check("completions", "echo")
def echo_prepends_prompt(target):
    """echo: the text begins with the prompt."""
    prompt = "Echo me, then go on"
    text = F.text(target.ok(PATH, {"prompt": prompt, "echo": True, "max_tokens": 3}).json["choices"][0])
    expect(text.startswith(prompt), f"echo: {text!r} does not begin with the prompt {prompt!r}")


def _echo(target, ids: list[int], k: int = 5) -> list[tuple]:
    r = target.ok(PATH, {"prompt": ids, "echo": True, "logprobs": k, "max_tokens": 1, "temperature": 0.0}).json
    positions = F.positions(r["choices"][0])
    expect(len(positions) == len(ids) + 1,
           f"echo with logprobs: {len(positions)} positions for {len(ids)} prompt tokens and 1 generated")  # fmt: skip
    return positions


@check("completions", "echo", "logprobs", "token_prompts")
def echo_logprobs_cover_prompt(target):
    """echo with logprobs: one position per prompt token plus the generated one; the first has no
    logprob (null), every other one has a logprob ≤ 0 and its top logprobs."""
    positions = _echo(target, server_ids(target).prompt)
    expect(positions[0][1] is None and positions[0][2] is None, f"the first prompt position has logprobs: {positions[0]}")
    for i, (token, logprob, top) in enumerate(positions[1:], 1):
        expect(isinstance(logprob, (int, float)) and logprob <= 1e-4 and top, f"position {i} ({token!r}): {logprob}, {top}")


@check("completions", "echo", "logprobs", "token_prompts", params=[("prompt", 3), ("last prompt", -1), ("generated", None)])
def echo_logprobs_at_their_positions(target, k):
    """The logprobs echo reports at a position are those of the model predicting that position: the
    same as a request whose prompt is the tokens before it (an echo shifted by one fails here)."""
    prompt = server_ids(target).prompt
    positions = _echo(target, prompt)
    cut = len(prompt) if k is None else k % len(prompt)
    r = target.ok(PATH, {"prompt": prompt[:cut], "logprobs": 5, "max_tokens": 1, "temperature": 0.0}).json
    (_, _, alone), = F.positions(r["choices"][0])
    token, logprob, echoed = positions[cut]
    expect(echoed and _tops_agree(echoed, alone),
           f"position {cut}: echo reports {echoed}, the model predicting it from the tokens before: {alone}")  # fmt: skip
    if token in alone:
        expect(math.isclose(logprob, alone[token], abs_tol=TOLERANCE), f"position {cut}: {token!r} echoed {logprob}, alone {alone[token]}")


@check("completions", "echo", "max_tokens_zero")
def echo_with_max_tokens_zero(target):
    """echo with max_tokens 0 (lm-eval's scoring request): the prompt alone, no completion token."""
    prompt = server_ids(target).prompt
    r = target.ok(PATH, {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1}).json
    expect(r["usage"]["completion_tokens"] == 0, f"max_tokens 0 generated {r['usage']['completion_tokens']} tokens")
    expect(len(F.positions(r["choices"][0])) == len(prompt), "echo positions are not the prompt's")


@check("completions", "return_token_ids", "token_prompts")
def return_token_ids(target):
    """return_token_ids (vLLM): each choice carries its generated ids and the prompt's."""
    prompt = server_ids(target).prompt
    r = target.ok(PATH, {"prompt": prompt, "max_tokens": 4, "return_token_ids": True, "temperature": 0.0}).json
    choice = r["choices"][0]
    expect(choice.get("prompt_token_ids") == prompt, f"prompt_token_ids {choice.get('prompt_token_ids')}, sent {prompt}")
    ids = choice.get("token_ids")
    expect(isinstance(ids, list) and len(ids) == r["usage"]["completion_tokens"],
           f"token_ids {ids} for {r['usage']['completion_tokens']} completion tokens")  # fmt: skip


@check("completions", "prompt_logprobs", "token_prompts")
def prompt_logprobs(target):
    """prompt_logprobs (vLLM): null for the first prompt position, then each position keyed by token
    id, the prompt's own token among them."""
    prompt = server_ids(target).prompt
    r = target.ok(PATH, {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}).json
    entries = r.get("prompt_logprobs", r["choices"][0].get("prompt_logprobs"))
    expect(isinstance(entries, list) and len(entries) == len(prompt), f"prompt_logprobs {str(entries)[:200]}")
    expect(entries[0] is None, f"the first prompt position has logprobs: {entries[0]}")
    for i, (token_id, entry) in enumerate(zip(prompt[1:], entries[1:]), 1):
        expect(isinstance(entry, dict) and str(token_id) in entry, f"position {i}: prompt token {token_id} not in {str(entry)[:200]}")


def _exact_ids(positions, watched: list[int], what: str) -> None:
    wanted = {f"token_id:{i}" for i in watched}
    expect(positions, f"{what}: no logprob positions")
    for i, (token, _, top) in enumerate(positions):
        expect(set(top or {}) == wanted | {token}, f"{what}, position {i}: top logprobs {sorted(top or {})}, asked "
               f"{sorted(wanted)} and the sampled {token!r}")  # fmt: skip


def logprob_ids(watched: list[int]) -> dict:
    """The fields asking for exactly the logprobs of ``watched`` (and the sampled token), by id."""
    return {"logprobs": 0, "logprob_token_ids": watched, "return_tokens_as_token_ids": True}


@check("completions", "logprob_token_ids", "n")
def logprob_token_ids_exact(target):
    """logprob_token_ids: at every position of every choice (n = 2), exactly the sampled token and
    the ids asked for."""
    watched = server_ids(target).watched
    r = target.ok(PATH, {"prompt": "Name a colour:", "max_tokens": 5, "n": 2, "temperature": 1.0, **logprob_ids(watched)}).json
    for c in by_index(r, 2).values():
        _exact_ids(F.positions(c), watched, f"choice {c['index']}")


@check("completions", "logprob_token_ids", "stream")
def logprob_token_ids_exact_streamed(target):
    """logprob_token_ids streamed: every chunk's positions list exactly the sampled token and the ids."""
    watched = server_ids(target).watched
    reply = target.ok(PATH, {"prompt": "Name a colour:", "max_tokens": 5, "stream": True, **logprob_ids(watched)})
    stream = read_stream(reply, F.delta_text)
    expect_choices(stream, 1)
    _exact_ids([p for ch in stream.chunks for c in ch["choices"] if c.get("logprobs") for p in F.positions(c)], watched, "stream")
