"""The length rules of a request, stated once: the prompt and ``max_tokens`` fit the context,
``min_tokens`` fits ``max_tokens``, and the whole request's work (prompts × ``n`` × ``max_tokens``)
fits ``--max-request-tokens``.

:class:`gyrfalcon.validation.RequestValidator` decides the first two, once, for every engine
request — the translator's (whose ``max_tokens`` it resolved, and which names the field as the
client wrote it) and those of callers without a translation; the translator decides the third over
a request's prompts.
"""

from __future__ import annotations

from gyrfalcon.engine_api.types import SamplingParams


def context_overflow(prompt_len: int, max_tokens: int, max_model_len: int) -> str | None:
    """What does not fit a context of ``max_model_len`` tokens, or None when all of it does:
    ``"prompt"`` when the prompt alone leaves no room (a prompt of exactly ``max_model_len`` tokens
    fits only when nothing is generated), ``"max_tokens"`` when the prompt and ``max_tokens``
    together exceed it."""
    if prompt_len > max_model_len or (max_tokens > 0 and prompt_len >= max_model_len):
        return "prompt"
    if prompt_len + max_tokens > max_model_len:
        return "max_tokens"
    return None


def context_message(overflow: str, prompt_len: int, max_tokens: int, max_model_len: int) -> str:
    """The message of :func:`context_overflow`'s verdict ``overflow``."""
    if overflow == "prompt":
        return f"The prompt has {prompt_len} tokens; this model's context is {max_model_len} tokens"
    return (f"This model's context is {max_model_len} tokens, but {prompt_len} prompt tokens + {max_tokens} "
            f"completion tokens were requested")  # fmt: skip


def min_tokens_problem(min_tokens: int, max_tokens: int) -> str | None:
    """Why ``min_tokens`` does not fit ``max_tokens`` (the effective one), or None when it does."""
    if min_tokens < 0:
        return f"'min_tokens' ({min_tokens}) must not be negative"
    if min_tokens > max_tokens:
        return f"'min_tokens' ({min_tokens}) must not exceed 'max_tokens' ({max_tokens})"
    return None


#: logprob entries per token that count as one more token of work (OpenAI's most top_logprobs)
LOGPROB_ENTRIES_PER_TOKEN = 20


def request_work(n: int, max_tokens: int, logprob_entries: int) -> float:
    """The work one prompt of a request may ask for, in tokens: ``n × max_tokens``, each token
    counting ``1 + logprob_entries / 20`` (its top logprobs and ``logprob_token_ids`` reported too).
    A request's work is the sum over its prompts; :func:`default_request_tokens` bounds it."""
    return n * max_tokens * (1 + logprob_entries / LOGPROB_ENTRIES_PER_TOKEN)


def sampling_work(sampling: SamplingParams) -> float:
    """:func:`request_work` of one engine request: its top logprobs and ``logprob_token_ids`` counted."""
    return request_work(sampling.n, sampling.max_tokens, (sampling.logprobs or 0) + len(sampling.logprob_token_ids or ()))


def default_request_tokens(max_num_seqs: int, max_model_len: int) -> int:
    """The most work one request may ask for when ``--max-request-tokens`` is not set: twice a
    full running batch of full contexts — every choice of a request that fits the batch may run to
    the context with all of OpenAI's top logprobs, and no request holds the server much longer than
    one batch of the longest answers would."""
    return 2 * max_num_seqs * max_model_len


def work_message(work: float, limit: int) -> str:
    """Why a request whose :func:`request_work` sums to ``work`` is refused under ``limit``."""
    return (f"This request may generate {work:,.0f} tokens of work (prompts x n x max_tokens, a token with "
            f"logprobs counting 1 + entries/{LOGPROB_ENTRIES_PER_TOKEN}), more than the {limit:,} one request may "
            f"ask of this server (--max-request-tokens): ask for fewer tokens, choices or prompts")  # fmt: skip
