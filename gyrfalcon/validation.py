"""The one validation point of an engine request: every rule it must satisfy, decided before submit.

The translator runs :meth:`RequestValidator.check` on each engine request it makes (naming the
fields as the client wrote them); callers that build engine requests themselves (benchmarks, tests)
run the same check. An engine's ``submit`` trusts what it is given and checks only what only it
knows: that its KV cache can ever hold the request, and its queue.

The checks, in order: what the request asks against the engine's capabilities
(:meth:`RequestValidator.check_supported`, the one place that decides "not supported"; the API side
runs it first on the wire fields, which name what the client asked as it wrote it), the output
kind, the fields' bounds (:meth:`RequestValidator.check_bounds`: the documents' keywords and the
deployment's :data:`~gyrfalcon.engine_api.limits.FIELD_LIMITS` — for a request built without the
API only, since the wire decided them for one that came through it), the context
(``engine_api/lengths.py``), ``max_tokens``, ``min_tokens``, the stop strings, each policy's own
rules (its ``validate``), then the plugins' ``gyrfalcon_validate_request``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gyrfalcon.engine_api.lengths import context_message, context_overflow, min_tokens_problem
from gyrfalcon.engine_api.limits import FIELD_KEYWORDS, ServedLimits, item_refusal, keyword_refusal, limits_of
from gyrfalcon.engine_api.types import EngineInfo, EngineRequest, OutputKind
from gyrfalcon.errors import RequestError
from gyrfalcon.policies import LogitsProcessor, LogprobGatherer

#: ``SamplingParams`` fields (and ``cache_salt``) an engine honours itself; processors and
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


#: the documents' keywords of an engine field that the endpoints bound differently (``FIELD_KEYWORDS``
#: None): the least all of them allow, which the engine serves; and the prompt's, which is
#: generate's ``token_ids``
ENGINE_KEYWORDS: dict[str, dict[str, Any]] = {"n": {"minimum": 1}, "logprobs": {"minimum": 0}, "prompt": {"minItems": 1}}

#: what a deployment needs to honour a refused field, when it is a setting
UNSUPPORTED_HINT: dict[str, str] = {
    "priority": ": only priority 0 runs without --scheduling-policy priority",
}


def _not_supported(name: str, param: str) -> RequestError:
    """The refusal of a field (or ``extensions.NAME``) the engine cannot honour, naming ``param``."""
    if name.startswith("extensions."):
        return RequestError(f"Extension '{name.partition('.')[2]}' is not supported by this server's engine", name)
    return RequestError(f"'{name}' is not supported by this server{UNSUPPORTED_HINT.get(name, '')}", param)


#: one thing a request asks for: (the capability it needs, the field as refused, the param named)
Ask = tuple[str, str, str]


def engine_asks(request: EngineRequest) -> list[Ask]:
    """What an engine request asks beyond the defaults: its ``SamplingParams`` fields set to
    something other than their default, a ``cache_salt``, a non-zero ``priority``, its extensions."""
    asks: list[Ask] = [(name, name, name) for name in sorted(request.sampling.asked_fields())]
    if request.cache_salt is not None:
        asks.append(("cache_salt", "cache_salt", "cache_salt"))
    if request.priority != 0:
        asks.append(("priority", "priority", "priority"))
    if request.lora_name is not None:
        asks.append(("lora", "lora_name", "lora_name"))
    asks += [(name, f"extensions.{name}", f"extensions.{name}") for name in sorted(request.extensions)]
    return asks


def policies(pm: Any, info: EngineInfo) -> tuple[list[LogitsProcessor], list[LogprobGatherer]]:
    """The logits processors and logprob gatherers the plugins of ``pm`` give an engine of ``info``
    (the same hooks an engine builds its own from; their ``validate`` needs no torch)."""
    processors = [p for result in pm.hook.gyrfalcon_logits_processors(info=info) for p in (result or [])]
    gatherers = [g for result in pm.hook.gyrfalcon_logprob_gatherers(info=info) for g in (result or [])]
    return processors, gatherers


class RequestValidator:
    """Every rule of an :class:`EngineRequest` for one engine (see the module docstring)."""

    def __init__(
        self,
        info: EngineInfo,
        processors: Sequence[LogitsProcessor] = (),
        gatherers: Sequence[LogprobGatherer] = (),
        hook: Callable[..., Any] | None = None,
    ) -> None:
        self.info = info
        self.policies = [*processors, *gatherers]
        #: the deployment's bounds, as the engine states them (the translator's may be narrower)
        self.limits = ServedLimits(
            model_names=[], vocab_size=info.vocab_size, max_model_len=info.max_model_len,
            max_request_seqs=info.max_request_seqs, max_logprobs=info.max_logprobs,
        )  # fmt: skip
        #: the plugins' ``gyrfalcon_validate_request`` (None: none run)
        self.hook = hook

    @classmethod
    def of(cls, pm: Any, info: EngineInfo) -> RequestValidator:
        """The validator of an engine of ``info`` served with the plugins of ``pm``."""
        return cls(info, *policies(pm, info), hook=pm.hook.gyrfalcon_validate_request)

    def check(self, request: EngineRequest, endpoint: str | None = None, submitted: bool = True,
              bounds_decided: bool = False) -> None:  # fmt: skip
        """Raise :class:`RequestError` (naming the engine request's field) for anything the engine
        cannot serve; ``endpoint``: the name the plugins' hook is told (None: the hook does not run).
        ``submitted`` False: a request the API side answers from its prompt alone (an echo that
        generates nothing): only that its prompt fits the context, ``min_tokens``, and the hook.
        ``bounds_decided``: the fields' bounds were decided on the wire (the translator's requests),
        so :meth:`check_bounds` does not decide them again."""
        if not submitted:
            self._check_context(request, prompt_only=True)
            self.check_hook(request, endpoint)
            return
        info = self.info
        params = request.sampling
        self.check_supported(engine_asks(request))
        try:
            OutputKind(request.output_kind)
        except ValueError:
            raise RequestError(f"unknown output kind {request.output_kind!r}", "output_kind") from None
        if not bounds_decided:
            self.check_bounds(request)
        self._check_lengths(request)
        for policy in self.policies:
            policy.validate(params, request.extensions, info)
        self.check_hook(request, endpoint)

    def check_hook(self, request: EngineRequest, endpoint: str | None) -> None:
        """The plugins' ``gyrfalcon_validate_request`` alone (for a request the API side answers
        without the engine, such as an echo that generates nothing)."""
        if self.hook is not None and endpoint is not None:
            self.hook(endpoint=endpoint, request=request, info=self.info)

    def check_supported(self, asks: Iterable[Ask]) -> None:
        """Refuse the first ask whose capability this engine lacks, naming its field: the one
        decision of "not supported", for the engine request's fields (:func:`engine_asks`) and the
        wire's (:func:`gyrfalcon.protocol.capabilities.wire_asks`) alike."""
        for capability, name, param in asks:
            if capability not in self.info.capabilities:
                raise _not_supported(name, param)

    def _check_context(self, request: EngineRequest, prompt_only: bool) -> None:
        """The prompt and ``max_tokens`` fit the context and ``min_tokens`` fits ``max_tokens``
        (``engine_api/lengths.py``); ``prompt_only``: nothing is generated."""
        params, prompt_len, context = request.sampling, len(request.prompt_token_ids), self.info.max_model_len
        # a request that must generate asks for at least one token, whatever max_tokens it gave
        asked = params.max_tokens if prompt_only else max(params.max_tokens, 1)
        overflow = context_overflow(prompt_len, asked, context)
        if overflow == "prompt":
            raise RequestError(context_message(overflow, prompt_len, asked, context), "prompt")
        if params.max_tokens < 1 and not prompt_only:
            raise RequestError("max_tokens must be at least 1 (0 only with prompt_logprobs)", "max_tokens")
        if overflow is not None:
            raise RequestError(context_message(overflow, prompt_len, params.max_tokens, context), "max_tokens")
        problem = min_tokens_problem(params.min_tokens, params.max_tokens)
        if problem is not None:
            raise RequestError(problem, "min_tokens")

    def check_bounds(self, request: EngineRequest) -> None:
        """The bounds of the request's fields as the wire decides them for a request that came
        through the API: the documents' keywords (:mod:`gyrfalcon.engine_api.limits`; the prompt's
        are generate's ``token_ids``), those of string items (the stop strings', the bad words')
        and the deployment's ``FIELD_LIMITS`` (the vocabulary, ``n``, the logprob counts, the
        context), over the prompt and every field set off its default."""
        params = request.sampling
        fields = {"prompt": request.prompt_token_ids, **{name: getattr(params, name) for name in sorted(params.asked_fields())}}
        for name, value in fields.items():
            if value is None:
                continue
            keywords = ENGINE_KEYWORDS.get(name) or FIELD_KEYWORDS.get(name) or {}
            refusal = keyword_refusal(value, keywords, name)
            if refusal is not None:
                raise RequestError(refusal, name)
            refused = item_refusal(value, name)
            if refused is not None:
                raise RequestError(refused[1], refused[0])
            for limit in limits_of(name):
                refused = limit.check(value, self.limits, name)
                if refused is not None:
                    raise RequestError(refused[1], refused[0])

    def _check_lengths(self, request: EngineRequest) -> None:
        params = request.sampling
        # the logprob path: a prefill only
        self._check_context(request, prompt_only=params.max_tokens == 0 and params.prompt_logprobs is not None)
