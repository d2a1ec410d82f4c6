"""Internal request objects: what the serving layer needs once the wire model has been translated."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gyrfalcon.engine_api.types import EngineRequest
from gyrfalcon.protocol.endpoints import Endpoint, endpoint_of
from gyrfalcon.protocol.rules import RequestFields


@dataclass
class ToolUse:
    """A chat request's tools: what is offered, what ``tool_choice`` asks, and the convention
    (``parser``, a :class:`gyrfalcon.tools.parsers.ToolCallParser`) calls are written and read in."""

    tools: list[dict[str, Any]]
    #: "auto", "required", or the one function's name
    choice: str
    parallel: bool
    parser: Any


@dataclass(frozen=True)
class WireNames:
    """Where one request's fields are on the wire: an engine-side ``param`` (``SamplingParams`` names,
    ``prompt``, ``structured_outputs.*``) → the field as its client wrote it.

    Decided once, when the request is translated, and used for every refusal that names a field
    after the rules: the validation hooks', a refused submit's, an in-band error's.
    """

    endpoint: Endpoint
    #: the field a constraint came from when it is not ``structured_outputs``: ``response_format`` or
    #: ``tools`` (a call the request forces)
    constraint: str | None = None
    #: a request turned into a chat request: chat's field names → the client's (None: the same)
    names: Callable[[str | None], str | None] | None = None
    #: the field that set ``max_tokens`` (``max_completion_tokens`` on chat wins); None: the
    #: server chose it from what the prompt leaves, and a refusal of it names the prompt, which is
    #: what the client sent
    max_tokens: str | None = "max_tokens"

    def __call__(self, param: str | None) -> str | None:
        if param is None:
            return None
        if param == "max_tokens":
            param = self.max_tokens or "prompt"
        if self.constraint is not None and param.partition(".")[0] == "structured_outputs":
            schema = self.constraint == "response_format" and param == "structured_outputs.json"
            param = "response_format.json_schema.schema" if schema else self.constraint
        else:
            param = self.endpoint.wire_param(param)
        return self.names(param) if self.names is not None else param


def max_tokens_field(f: RequestFields) -> str | None:
    """The field that sets ``max_tokens`` (chat's ``max_completion_tokens`` wins over its
    ``max_tokens``), or None when the client set neither."""
    if f.has("max_completion_tokens"):
        return "max_completion_tokens"
    return "max_tokens" if f.get("max_tokens") is not None else None


def wire_names(f: RequestFields) -> WireNames:
    """Where the request's fields are on the wire; a constraint is named after the field it came
    from: the tools when the request forces a call, else a response_format other than text."""
    constraint = None
    if f.has("tools") and f.get("tool_choice") not in (None, "none", "auto"):
        constraint = "tools"  # the calls' grammar: a tool's parameters schema does not compile
    elif (f.get("response_format") or {"type": "text"})["type"] != "text":
        constraint = "response_format"
    return WireNames(f.endpoint, constraint, max_tokens=max_tokens_field(f))


@dataclass
class ServingRequest:
    """One HTTP request, translated: its engine requests and how to present their outputs.

    ``requests`` holds one engine request per prompt (completions with several prompts) or per
    conversation (batch chat); choice ``j`` of prompt ``i`` is presented with index ``i * n + j``
    (batch chat: ``n`` is 1, so index = conversation).
    """

    endpoint: Endpoint
    model: str
    response_id: str
    requests: list[EngineRequest]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    #: every chunk carries the usage of its prompt and choice so far (vLLM's continuous_usage_stats)
    continuous_usage: bool = False
    echo: bool = False
    #: completions: each prompt's text (echo); chat: what echo puts before each conversation's choices
    prompt_texts: list[str] = field(default_factory=list)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    #: chat: logprobs asked (bool); completions/generate: the top-k count or None
    logprobs: Any = None
    #: completions with echo and max_tokens 0 and no logprobs: answered from the prompt alone, without
    #: the engine (with logprobs, a prefill-only engine request computes the prompt's logprobs)
    prompt_only: bool = False
    #: the wire ``prompt_logprobs`` count (None: not asked); the engine may gather more for echo
    prompt_logprobs: int | None = None
    #: each finished choice says which weights made which tokens (``weight_versions``; a server
    #: with ``--enable-rl-endpoints``, whose weights may be replaced while it runs)
    weight_versions: bool = False
    #: the client's end-user id (OpenAI's ``user``): recorded in the access log, never used for sampling
    user: str | None = None
    #: fields that change nothing in the output, recorded in the access log (``metadata``,
    #: ``service_tier``, ``safety_identifier``, ``prompt_cache_key``)
    recorded: dict[str, Any] = field(default_factory=dict)
    #: where its fields are on the wire: every engine-side ``param`` is named through it
    wire_names: WireNames | None = None
    #: chat with tools (and tool_choice other than none): calls in the answer become ``tool_calls``
    tools: ToolUse | None = None
    #: the Responses request's own fields, echoed in the response object
    response_fields: dict[str, Any] = field(default_factory=dict)
    #: the conversation before this request's input (``previous_response_id``'s), as chat turns
    history: list[dict[str, Any]] = field(default_factory=list)
    #: this request's input as chat turns (what a later previous_response_id continues)
    input_turns: list[dict[str, Any]] = field(default_factory=list)
    #: this request's input as items with ids (``GET /v1/responses/{id}/input_items``)
    input_items: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.endpoint = endpoint_of(self.endpoint)
        if self.wire_names is None:
            self.wire_names = WireNames(self.endpoint)

    def wire_param(self, param: str | None) -> str | None:
        """An engine-side ``param`` (an in-band error's, a refused submit's) as this client wrote it."""
        assert self.wire_names is not None
        return self.wire_names(param)
