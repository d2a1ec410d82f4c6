"""Token ids a check may send, learned from the server under check — never constants its model may
lack (a small vocabulary refuses id 401 with a correct 400, and the check would be "unsupported").

Where they come from, first that answers: the server's tokenizer (vLLM's and gyrfalcon's
``/tokenize``, llama-cpp-python's ``/extras/tokenize``, llama.cpp's ``/tokenize``); the prompt ids a
completion reports (vLLM's ``return_token_ids``); the ids of its logprob tokens
(``return_tokens_as_token_ids``); else the smallest ids, which every vocabulary has.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the text whose tokens make the prompt and the watched ids
TEXT = "The quick brown fox jumps over the lazy dog. Red, green and blue."
#: how many ids a token-id prompt holds, and how many ids logprob_token_ids asks for
PROMPT_LENGTH, WATCHED_COUNT = 7, 4


@dataclass(frozen=True)
class ServerIds:
    """``prompt``: a token-id prompt; ``watched``: distinct ids to ask logprobs of; ``source``: where
    they came from (shown when a check that uses them fails)."""

    prompt: list[int]
    watched: list[int]
    source: str


def _ints(value) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        return value
    return None


def _from_tokenizer(target) -> tuple[list[int], str] | None:
    attempts = [
        ("/tokenize", {"model": target.model, "prompt": TEXT, "add_special_tokens": False}),
        ("/tokenize", {"model": target.model, "prompt": TEXT}),
        ("/extras/tokenize", {"model": target.model, "input": TEXT}),
        ("/tokenize", {"content": TEXT}),
    ]
    for path, body in attempts:
        reply = target.post(path, body)
        if reply.status == 200 and isinstance(reply.json, dict) and (ids := _ints(reply.json.get("tokens"))):
            return ids, f"POST {path}"
    return None


def _from_completions(target) -> tuple[list[int], str] | None:
    reply = target.post("/v1/completions", {"model": target.model, "prompt": TEXT, "max_tokens": 4, "temperature": 0.0,
                                            "return_token_ids": True, "logprobs": 0,
                                            "return_tokens_as_token_ids": True})  # fmt: skip
    if reply.status != 200 or not isinstance(reply.json, dict) or not reply.json.get("choices"):
        return None
    choice = reply.json["choices"][0]
    if ids := _ints(choice.get("prompt_token_ids")):
        return ids + (_ints(choice.get("token_ids")) or []), "the prompt_token_ids of a completion"
    tokens = ((choice.get("logprobs") or {}).get("tokens")) or []
    ids = [int(t[9:]) for t in tokens if isinstance(t, str) and t.startswith("token_id:") and t[9:].isdigit()]
    return (ids, "the token_id: logprob tokens of a completion") if ids else None


def server_ids(target) -> ServerIds:
    """The ids the checks send to ``target`` (found once per target, then kept on it)."""
    found = target.learned.get("ids")
    if found is None:
        replies = len(target.replies)
        ids, source = _from_tokenizer(target) or _from_completions(target) or ([], "")
        del target.replies[replies:]  # the search is not the check: a failure's curl line is the check's own
        distinct = list(dict.fromkeys(ids))
        if len(ids) < PROMPT_LENGTH or len(distinct) < WATCHED_COUNT:
            smallest = list(range(max(PROMPT_LENGTH, WATCHED_COUNT)))
            ids, distinct, source = smallest, smallest, "the smallest ids (the server tells none of its own)"
        found = ServerIds(ids[:PROMPT_LENGTH], distinct[-WATCHED_COUNT:], source)
        target.learned["ids"] = found
    return found
