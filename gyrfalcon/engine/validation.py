"""Synchronous checks of an incoming request against the engine's limits and capabilities."""

from __future__ import annotations

from collections.abc import Sequence

from gyrfalcon.engine_api.types import EngineInfo, EngineRequest, OutputKind
from gyrfalcon.errors import RequestError
from gyrfalcon.engine_api.lengths import context_message, context_overflow, min_tokens_problem
from gyrfalcon.engine_api.vocabulary import first_outside_vocabulary, outside_vocabulary
from gyrfalcon.policies import LogitsProcessor, LogprobGatherer

#: ``SamplingParams`` fields (and ``cache_salt``) the engine honours itself; processors and
#: gatherers add theirs.
NATIVE_CAPABILITIES = frozenset(
    {
        "cache_salt",
        "n",
        "max_tokens",
        "min_tokens",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "include_stop_str_in_output",
        "detokenize",
        "skip_special_tokens",
        "spaces_between_special_tokens",
    }
)


def validate_request(
    request: EngineRequest,
    info: EngineInfo,
    processors: Sequence[LogitsProcessor] = (),
    gatherers: Sequence[LogprobGatherer] = (),
) -> None:
    """Raise :class:`RequestError` (400 with ``param``) for anything this engine cannot serve."""
    params = request.sampling
    for name in sorted(params.asked_fields() - info.capabilities):
        raise RequestError(f"{name} is not supported by this server", name)
    if request.cache_salt is not None and "cache_salt" not in info.capabilities:
        raise RequestError("cache_salt is not supported by this server", "cache_salt")
    if request.priority != 0 and "priority" not in info.capabilities:
        raise RequestError("a non-zero priority needs the priority scheduling policy (--scheduling-policy priority)", "priority")
    for name in sorted(set(request.extensions) - info.capabilities):
        raise RequestError(f"extension {name} is not supported by this server", f"extensions.{name}")
    try:
        OutputKind(request.output_kind)
    except ValueError:
        raise RequestError(f"unknown output kind {request.output_kind!r}", "output_kind") from None

    prompt = request.prompt_token_ids
    if not prompt:
        raise RequestError("the prompt must contain at least one token", "prompt")
    for name, ids in (("prompt", prompt), ("stop_token_ids", params.stop_token_ids)):
        bad = first_outside_vocabulary(ids, info.vocab_size)
        if bad is not None:
            raise RequestError(outside_vocabulary(bad, name, info.vocab_size), name)
    if not 1 <= params.n <= info.max_request_seqs:
        raise RequestError(f"n must be between 1 and {info.max_request_seqs}", "n")
    prompt_only = params.max_tokens == 0 and params.prompt_logprobs is not None  # logprob path: prefill only
    # a request that must generate asks for at least one token, whatever max_tokens it gave
    asked = params.max_tokens if prompt_only else max(params.max_tokens, 1)
    overflow = context_overflow(len(prompt), asked, info.max_model_len)
    if overflow == "prompt":
        raise RequestError(context_message(overflow, len(prompt), asked, info.max_model_len), "prompt")
    if params.max_tokens < 1 and not prompt_only:
        raise RequestError("max_tokens must be at least 1 (0 only with prompt_logprobs)", "max_tokens")
    if overflow is not None:
        raise RequestError(context_message(overflow, len(prompt), params.max_tokens, info.max_model_len), "max_tokens")
    problem = min_tokens_problem(params.min_tokens, params.max_tokens)
    if problem is not None:
        raise RequestError(problem, "min_tokens")
    if any(not s for s in params.stop):
        raise RequestError("stop strings must not be empty", "stop")
    for policy in [*processors, *gatherers]:
        policy.validate(params, request.extensions, info)
