"""The inference endpoints, one object each: what the rest of the code asks of an endpoint, so none
of it tests an endpoint's name.

An :class:`Endpoint` holds its route, its generated wire model and documented defaults, how its
prompts are given (:class:`Prompts`), how its logprobs are asked for, the prefix of its response ids
and where its fields live on the wire (generate nests the sampling fields under
``sampling_params``). The translator, the rules and the serving layer read these; the formatter of
each endpoint is chosen by the serving layer (:data:`gyrfalcon.serving.runner.FORMATTERS`).
Adding an endpoint is adding an object here, its formatter, and its route.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import pydantic
import pydantic_core

from gyrfalcon import generated


class Prompts(enum.Enum):
    """How an endpoint's request gives its prompt(s)."""

    #: ``token_ids``: one prompt of token ids
    TOKEN_IDS = "token_ids"
    #: ``prompt``: a text, a list of token ids, or a list of either (several prompts)
    TEXT_OR_IDS = "text_or_ids"
    #: ``messages``: one conversation, rendered with the chat template
    CONVERSATION = "conversation"
    #: ``messages``: a list of conversations, one choice each
    CONVERSATIONS = "conversations"


def wire_defaults(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """Documented defaults of a generated model's fields, by wire name."""
    defaults = {}
    for name, info in model.model_fields.items():
        default = info.default
        if default is pydantic_core.PydanticUndefined or default is getattr(pydantic, "MISSING", object()):
            continue
        if default is None and not info.is_required() and info.annotation is not None and "None" not in str(info.annotation):
            continue
        defaults[info.alias or name] = default
    return defaults


@dataclass(frozen=True, eq=False)
class Endpoint:
    """One inference endpoint (see the module docstring)."""

    #: the name hooks and the access log know it by (``gyrfalcon_validate_request``'s ``endpoint``)
    name: str
    route: str
    wire_model: type[pydantic.BaseModel]
    #: ``{id_prefix}-{id}``: the response's id
    id_prefix: str
    prompts: Prompts
    #: the field that holds the prompt (what an engine error on ``prompt`` names)
    prompt_param: str
    #: chat's logprobs: ``logprobs`` a bool and ``top_logprobs`` the count (else ``logprobs`` is the count)
    chat_logprobs: bool = False
    #: ``max_tokens`` when the client sets none (None: what the context leaves after the prompt)
    default_max_tokens: int | None = None
    #: ``echo`` with ``max_tokens`` 0 is answered from the prompt alone
    echoes_prompt_alone: bool = False
    #: the object the sampling fields are nested in on the wire, with its generated model
    nested: str | None = None
    nested_model: type[pydantic.BaseModel] | None = None
    #: fields that stay at the top level of the body when fields are nested
    top_level: frozenset[str] = frozenset()
    #: the request is turned into a chat request (:mod:`gyrfalcon.protocol.responses`) before the
    #: rules: its fields then have chat's names and defaults
    as_chat: bool = False
    #: its answers are kept in the response store (``store``, ``previous_response_id``)
    stored: bool = False
    #: between the id prefix and the id (``chatcmpl-…``, ``resp_…``)
    id_separator: str = "-"

    @property
    def chat(self) -> bool:
        """Conversations rendered with the chat template (so tools may be offered)."""
        return self.prompts in (Prompts.CONVERSATION, Prompts.CONVERSATIONS)

    @property
    def batch(self) -> bool:
        """Several conversations, one choice each (never streamed)."""
        return self.prompts is Prompts.CONVERSATIONS

    def response_id(self, given: str) -> str:
        """The response's id around ``given`` (the client's request id, or a fresh one)."""
        return f"{self.id_prefix}{self.id_separator}{given}"

    @cached_property
    def defaults(self) -> dict[str, Any]:
        """The documented defaults of every field, by (flattened) wire name (chat's, for a request
        turned into a chat request)."""
        values = wire_defaults(generated.ChatCompletionRequest if self.as_chat else self.wire_model)
        if self.nested_model is not None:
            values.update(wire_defaults(self.nested_model))
        return values

    @cached_property
    def key_patterns(self) -> dict[str, str]:
        """The maps among the fields of its sampling object whose keys the documents give a pattern
        (``propertyNames``: logit_bias's token ids), with the pattern."""
        from gyrfalcon.openapi.served import fields_stating

        model = self.nested_model or self.wire_model
        names = {info.alias or name for name, info in model.model_fields.items()}
        return {name: keys["pattern"] for name, keys in fields_stating("propertyNames").items() if name in names}

    def flatten(self, body: dict[str, Any]) -> dict[str, Any]:
        """The sent fields with the nested object's merged in (one namespace for the rules)."""
        values = dict(body)
        if self.nested is not None:
            values.update(values.pop(self.nested, None) or {})
        return values

    def nested_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The object of ``body`` that holds the sampling fields (the body itself unless nested)."""
        return body.get(self.nested, body) if self.nested is not None else body

    def param(self, name: str) -> str:
        """A flattened field's name as the client wrote it (``sampling_params.top_k`` on generate); a
        dotted name is placed by its first part (``extensions.demo`` stays at the top level)."""
        head = name.partition(".")[0]
        if self.nested is not None and head not in self.top_level:
            return f"{self.nested}.{name}"
        return name

    def wire_param(self, param: str | None) -> str | None:
        """An engine-side ``param`` (``SamplingParams`` names, ``prompt``) as the client wrote it."""
        if param is None:
            return None
        if param.partition(".")[0] == "prompt":
            return self.prompt_param
        return self.param(param)

    def __repr__(self) -> str:
        return f"Endpoint({self.name!r})"


GENERATE = Endpoint(
    "generate", "/inference/v1/generate", generated.GenerateRequest, "generate-tokens", Prompts.TOKEN_IDS, "token_ids",
    nested="sampling_params", nested_model=generated.GenerateSamplingParams,
    top_level=frozenset({"token_ids", "sampling_params", "model", "stream", "stream_options", "request_id", "cache_salt",
                         "priority", "extensions"}),
)  # fmt: skip
COMPLETIONS = Endpoint(
    "completions", "/v1/completions", generated.CompletionRequest, "cmpl", Prompts.TEXT_OR_IDS, "prompt",
    default_max_tokens=16, echoes_prompt_alone=True,
)  # fmt: skip
CHAT = Endpoint("chat", "/v1/chat/completions", generated.ChatCompletionRequest, "chatcmpl", Prompts.CONVERSATION,
                "messages", chat_logprobs=True)  # fmt: skip
CHAT_BATCH = Endpoint("chat_batch", "/v1/chat/completions/batch", generated.BatchChatCompletionRequest, "chatcmpl",
                      Prompts.CONVERSATIONS, "messages", chat_logprobs=True)  # fmt: skip

RESPONSES = Endpoint("responses", "/v1/responses", generated.ResponsesRequest, "resp", Prompts.CONVERSATION, "messages",
                     chat_logprobs=True, as_chat=True, stored=True, id_separator="_")  # fmt: skip

#: every inference endpoint, by name
ENDPOINTS: dict[str, Endpoint] = {e.name: e for e in (GENERATE, COMPLETIONS, CHAT, CHAT_BATCH, RESPONSES)}


@dataclass(frozen=True, eq=False)
class TokenizerEndpoint:
    """A route of the tokenizer, beside the inference endpoints: its wire model, and its chat form's
    (a body with ``messages`` is tokenized as chat renders it; None: no such form)."""

    route: str
    wire_model: type[pydantic.BaseModel]
    chat_model: type[pydantic.BaseModel] | None = None

    def model_of(self, body: Any) -> type[pydantic.BaseModel]:
        """The wire model a body is read with: the chat form's when it has ``messages``."""
        if self.chat_model is not None and isinstance(body, dict) and "messages" in body:
            return self.chat_model
        return self.wire_model


TOKENIZE = TokenizerEndpoint("/tokenize", generated.TokenizeCompletionRequest, generated.TokenizeChatRequest)
DETOKENIZE = TokenizerEndpoint("/detokenize", generated.DetokenizeRequest)
#: the control routes RL trainers use, served only with ``--enable-rl-endpoints``
CONTROL_ROUTES = ("/pause", "/resume", "/is_paused", "/inference/v1/abort_requests", "/update_weights_from_disk",
                  "/weight_version", "/sleep", "/wake_up", "/is_sleeping")  # fmt: skip
#: vLLM's routes for LoRA adapters at run time, served only with ``--enable-lora``, and their wire models
LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
LOAD_LORA_ADAPTER = generated.LoadLoraAdapterRequest
UNLOAD_LORA_ADAPTER = generated.UnloadLoraAdapterRequest
#: the wire models of ``POST /inference/v1/abort_requests`` and ``POST /update_weights_from_disk``
ABORT_REQUESTS = generated.AbortRequestsRequest
UPDATE_WEIGHTS = generated.UpdateWeightsFromDiskRequest


def endpoint_of(endpoint: Endpoint | str) -> Endpoint:
    """The endpoint object (given one, or its name)."""
    return endpoint if isinstance(endpoint, Endpoint) else ENDPOINTS[endpoint]
