"""The length rules of a request, stated once: the prompt and ``max_tokens`` fit the context, and
``min_tokens`` fits ``max_tokens``.

The translation checks them with the resolved ``max_tokens`` and names the field as the client
wrote it; the engine checks them again at submit for callers that come without a translation (the
Python API, Ray). Both ask here, so the two verdicts and their messages cannot drift apart.
"""

from __future__ import annotations


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
