"""Cross-field rules of the protocol, by id.

The rules that JSON Schema can state are ALSO written in the OpenAPI documents as ``if``/``then``
blocks carrying the same ``x-rule`` id (so Schemathesis respects and attacks them); the others are
runtime-only and listed in the served spec's ``x-runtime-rules`` table. A test checks that every id
here is in one of the two places. Rules run after schema validation and before the "not supported"
check, in the order of :data:`RULES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gyrfalcon.engine_api.types import GREEDY_TEMPERATURE
from gyrfalcon.errors import RequestError
from gyrfalcon.protocol.endpoints import Endpoint, endpoint_of
from gyrfalcon.protocol.runtime_rules import translation_rule_ids


@dataclass(frozen=True)
class RequestFields:
    """The fields a client actually sent to ``endpoint``, flattened (generate's ``sampling_params``
    merged in)."""

    endpoint: Endpoint
    values: dict[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoint", endpoint_of(self.endpoint))

    @classmethod
    def from_body(cls, endpoint: Endpoint | str, body: dict[str, Any]) -> RequestFields:
        endpoint = endpoint_of(endpoint)
        return cls(endpoint, endpoint.flatten(body))

    def has(self, name: str) -> bool:
        return name in self.values

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def param(self, name: str) -> str:
        """The field's name as the client wrote it (``sampling_params.top_k`` on generate)."""
        return self.endpoint.param(name)

    def error(self, name: str, message: str) -> RequestError:
        return RequestError(message, self.param(name))


Rule = Callable[[RequestFields], None]

def wire_param(endpoint: Endpoint | str, param: str | None) -> str | None:
    """An engine-side ``param`` as the client of ``endpoint`` wrote it (:meth:`Endpoint.wire_param`)."""
    return endpoint_of(endpoint).wire_param(param)


def stream_options_requires_stream(f: RequestFields) -> None:
    if f.has("stream_options") and f.get("stream") is not True:
        raise f.error("stream_options", "'stream_options' is only allowed when 'stream' is true")


def prompt_logprobs_not_streaming(f: RequestFields) -> None:
    if f.has("prompt_logprobs") and f.get("stream") is True:
        raise f.error("prompt_logprobs", "'prompt_logprobs' is not available when streaming")


def n_greedy(f: RequestFields) -> None:
    if f.get("n", 1) > 1 and f.has("temperature") and f.get("temperature") < GREEDY_TEMPERATURE:
        raise f.error("n", "n > 1 needs sampling: greedy decoding (temperature < 1e-5) would repeat one choice")


def top_logprobs_requires_logprobs(f: RequestFields) -> None:
    if f.endpoint.chat_logprobs and (f.get("top_logprobs") or 0) > 0 and f.get("logprobs") is not True:
        raise f.error("top_logprobs", "'top_logprobs' above 0 requires 'logprobs': true")


def logprob_token_ids_requires_logprobs(f: RequestFields) -> None:
    if not f.has("logprob_token_ids"):
        return
    if not _asks_logprobs(f):
        wanted = "'logprobs': true" if f.endpoint.chat_logprobs else "'logprobs' to be set"
        raise f.error("logprob_token_ids", f"'logprob_token_ids' requires {wanted}")


def _asks_logprobs(f: RequestFields) -> bool:
    """Chat asks with ``logprobs: true``, the others with a count."""
    return f.get("logprobs") is True if f.endpoint.chat_logprobs else f.get("logprobs") is not None


def return_tokens_as_token_ids_requires_logprobs(f: RequestFields) -> None:
    if f.get("return_tokens_as_token_ids") is not True:  # (generate has no such field)
        return
    if not _asks_logprobs(f):
        raise f.error("return_tokens_as_token_ids", "'return_tokens_as_token_ids' only changes logprobs: it requires 'logprobs'")


def logprob_token_ids_not_beam_search(f: RequestFields) -> None:
    if f.has("logprob_token_ids") and f.get("use_beam_search") is True:
        raise f.error("logprob_token_ids", "'logprob_token_ids' cannot be combined with 'use_beam_search'")


def logprob_token_ids_not_echo_without_tokens(f: RequestFields) -> None:
    if f.has("logprob_token_ids") and _prompt_alone(f):
        raise f.error("logprob_token_ids", "'logprob_token_ids' needs generated positions: not with 'echo' and 'max_tokens': 0")


def _prompt_alone(f: RequestFields) -> bool:
    """``echo`` with ``max_tokens`` 0: the answer is the prompt alone (completions)."""
    return f.endpoint.echoes_prompt_alone and f.get("echo") is True and _zero_max_tokens(f)


def _zero_max_tokens(f: RequestFields) -> bool:
    return f.endpoint.echoes_prompt_alone and f.get("max_tokens", f.endpoint.default_max_tokens) == 0


def max_tokens_zero_requires_echo(f: RequestFields) -> None:
    if _zero_max_tokens(f) and f.get("echo") is not True:
        raise f.error("max_tokens", "'max_tokens': 0 is only allowed with 'echo': true")


def stop_requires_detokenize(f: RequestFields) -> None:
    if f.get("detokenize") is False and f.get("stop"):
        raise f.error("stop", "Stop strings need text: they cannot be used with 'detokenize': false")


def batch_chat_not_streaming(f: RequestFields) -> None:
    if f.endpoint.batch and f.get("stream") is True:
        raise f.error("stream", "Batch chat does not stream: 'stream' must be false")


#: Every rule JSON Schema can state, by id, in the order they are checked.
RULES: dict[str, Rule] = {
    "stream_options_requires_stream": stream_options_requires_stream,
    "prompt_logprobs_not_streaming": prompt_logprobs_not_streaming,
    "n_greedy": n_greedy,
    "top_logprobs_requires_logprobs": top_logprobs_requires_logprobs,
    "logprob_token_ids_requires_logprobs": logprob_token_ids_requires_logprobs,
    "return_tokens_as_token_ids_requires_logprobs": return_tokens_as_token_ids_requires_logprobs,
    "logprob_token_ids_not_beam_search": logprob_token_ids_not_beam_search,
    "logprob_token_ids_not_echo_without_tokens": logprob_token_ids_not_echo_without_tokens,
    "max_tokens_zero_requires_echo": max_tokens_zero_requires_echo,
    "batch_chat_not_streaming": batch_chat_not_streaming,
    "stop_requires_detokenize": stop_requires_detokenize,
}

#: The runtime rules checked while a request is translated (their texts and homes:
#: :mod:`gyrfalcon.protocol.runtime_rules`).
TRANSLATION_RULES = translation_rule_ids()


def check_rules(fields: RequestFields) -> None:
    """Run every cross-field rule; the first violated one raises its 400."""
    for rule in RULES.values():
        rule(fields)


def all_rule_ids() -> set[str]:
    return set(RULES) | set(TRANSLATION_RULES)
