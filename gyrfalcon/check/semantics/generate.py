"""Promises of the token-in, token-out endpoint (vLLM's /inference/v1/generate)."""

from __future__ import annotations

from gyrfalcon.check.registry import check
from gyrfalcon.check.semantics.flavours import by_index, expect, indices
from gyrfalcon.check.semantics.ids import server_ids
from gyrfalcon.check.semantics.stream_shape import expect_choices, read_stream

PATH = "/inference/v1/generate"


def _generate(target, stream: bool = False, **sampling):
    return target.ok(PATH, {"token_ids": server_ids(target).prompt, "sampling_params": {"max_tokens": 5, **sampling},
                            "stream": stream})  # fmt: skip


def _ids(choice: dict) -> list[int]:
    ids = choice.get("token_ids")
    expect(isinstance(ids, list) and all(isinstance(i, int) for i in ids), f"choice {choice.get('index')}: token_ids {ids}")
    return ids


@check("generate")
def token_ids_out(target):
    """Token ids in, token ids out: one choice with at most max_tokens ids and a finish reason;
    usage counts the prompt ids."""
    r = _generate(target).json
    expect(indices(r["choices"]) == [0], f"indices {indices(r['choices'])}")
    ids = _ids(r["choices"][0])
    expect(0 < len(ids) <= 5 and r["choices"][0].get("finish_reason") in ("stop", "length"), f"{len(ids)} ids for max_tokens 5")
    expect(r["usage"]["prompt_tokens"] == len(server_ids(target).prompt), f"usage.prompt_tokens {r['usage']['prompt_tokens']}")


@check("generate", "n")
def n_choices(target):
    """n = 3: three choices, indices 0..2 (the collapse to one choice vLLM's generate once had)."""
    for c in by_index(_generate(target, n=3, temperature=1.0).json, 3).values():
        _ids(c)


@check("generate", "seed", "n")
def seed_reproducible(target):
    """A seeded, sampled request twice: the same ids for every choice."""
    a, b = ({i: _ids(c) for i, c in by_index(_generate(target, n=2, temperature=1.0, seed=11).json, 2).items()} for _ in range(2))
    expect(a == b, f"seed 11 gave {a} then {b}")


@check("generate", "stream", "n", "seed")
def stream_equals_non_stream(target):
    """Streamed with n = 2: one choice per chunk, a finish per choice, the same ids as not streamed."""
    whole = {i: _ids(c) for i, c in by_index(_generate(target, n=2, temperature=1.0, seed=12).json, 2).items()}
    stream = read_stream(_generate(target, stream=True, n=2, temperature=1.0, seed=12))
    expect_choices(stream, 2)
    expect(stream.token_ids == whole, f"streamed {stream.token_ids}, not streamed {whole}")


@check("generate", "logprob_token_ids", "n")
def logprob_token_ids_exact(target):
    """logprob_token_ids: at every position of every choice exactly the sampled id and the ids asked."""
    watched = server_ids(target).watched
    # logprobs = the number of ids: vLLM's engine rule on generate's sampling params (another count is a 400)
    r = _generate(target, n=2, temperature=1.0, logprobs=len(watched), logprob_token_ids=watched).json
    wanted = {f"token_id:{i}" for i in watched}
    for c in by_index(r, 2).values():
        content = (c.get("logprobs") or {}).get("content")
        expect(isinstance(content, list) and len(content) == len(_ids(c)), f"choice {c['index']}: logprobs {str(content)[:200]}")
        for i, (entry, token_id) in enumerate(zip(content, _ids(c))):
            listed = {t["token"] for t in entry["top_logprobs"]}
            expect(entry["token"] == f"token_id:{token_id}" and listed == wanted | {entry["token"]},
                   f"choice {c['index']} position {i}: {entry['token']} listed {sorted(listed)}")  # fmt: skip
