"""This deployment's served spec: the bundled documents with the engine's limits laid over them."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from gyrfalcon.engine_api.config import LOGPROBS_MODES
from gyrfalcon.engine_api.interface import Engine
from gyrfalcon.engine_api.types import EngineInfo
from gyrfalcon.engine_api.limits import ServedLimits, largest_object, longest_array
from gyrfalcon.openapi.limits import walk_schemas
from gyrfalcon.openapi.served import bundle, request_field_names, served_spec
from gyrfalcon.protocol.capabilities import unsupported_fields
from gyrfalcon.protocol.endpoints import CONTROL_ROUTES, ENDPOINTS, LORA_ROUTES
from gyrfalcon.protocol.runtime_rules import served_table
from gyrfalcon.protocol.translate import SPEC_MAX_ITEMS, SPEC_MAX_PROPERTIES
from gyrfalcon.protocol.wire import MAX_DEPTH
from gyrfalcon.structured.grammar import MAX_CONSTRAINT_BYTES, MAX_CONSTRAINT_NODES

#: a plugin marks an integer schema of its extension fragment as a token id with this key
TOKEN_ID_MARK = "x-token-id"


def bounded_extensions(extensions: dict[str, dict[str, Any]], info: EngineInfo) -> dict[str, dict[str, Any]]:
    """The plugins' extension fragments with every ``x-token-id`` integer capped below the vocabulary.

    An extension no engine hook honours (not in the engine's capabilities) must be absent.
    """
    bounded = {
        name: copy.deepcopy(fragment) if name in info.capabilities else {"not": {}, "description": "Not honoured by this engine."}
        for name, fragment in extensions.items()
    }
    for node in walk_schemas(bounded):
        if node.get(TOKEN_ID_MARK) is True:
            node["maximum"] = min(node.get("maximum", info.vocab_size - 1), info.vocab_size - 1)
    return bounded


def unspellable_bytes(engine: Engine, vocab_size: int) -> list[int]:
    """The bytes no token of the vocabulary holds (SmolLM2: 0x04, 0x06, 0xf1…): a constraint that
    needs one cannot be met, and is refused while generating (rule constraints_leave_a_token)."""
    held: set[int] = set()
    try:
        for start in range(0, vocab_size, 4096):
            for raw in engine.token_bytes(list(range(start, min(start + 4096, vocab_size)))):
                held.update(raw)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say: publish nothing rather than a guess
        return []
    return sorted(set(range(256)) - held)


def chat_template_overhead(engine: Engine) -> dict[str, int] | None:
    """Tokens a chat template adds: ``fixed`` per conversation, ``per_message`` per message.

    None when the model has no usable chat template (a base model): chat is then not served.
    Measured with alternating roles, which every template accepts; a template that refuses even
    that gets a conservative bound (its whole one-message overhead, per message).
    """
    def count(roles: list[str]) -> int:
        text = engine.apply_chat_template([{"role": role, "content": ""} for role in roles], True)
        return len(engine.tokenize(text, add_special_tokens=False))

    try:
        one = count(["user"])
    except Exception:  # noqa: BLE001 - no template, or one that cannot render a user message
        return None
    try:
        per_message = -(-(count(["user", "assistant", "user"]) - one) // 2)
    except Exception:  # noqa: BLE001
        return {"fixed": one, "per_message": one}
    return {"fixed": max(one - per_message, 0), "per_message": max(per_message, 1)}


@dataclass(frozen=True)
class TemplateSupport:
    """Which optional message fields the chat template renders (an ignored one is refused, so the
    served spec states it as null): ``name``, assistant ``tool_calls``, ``tool`` turns."""

    names: bool = True
    tool_calls: bool = True
    tool_turns: bool = True

    @classmethod
    def probe(cls, engine: Engine) -> TemplateSupport:
        user = {"role": "user", "content": "x"}
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}

        def renders(plain: list[dict[str, Any]], marked: list[dict[str, Any]]) -> bool:
            try:
                return engine.apply_chat_template(marked, True) != engine.apply_chat_template(plain, True)
            except Exception:  # noqa: BLE001 - no usable template, or one that refuses these turns
                return False

        assistant = {"role": "assistant", "content": ""}
        tool = {"role": "tool", "content": "y", "tool_call_id": "c1"}
        return cls(
            names=renders([user], [{**user, "name": "someone"}]),
            tool_calls=renders([user, assistant], [user, {**assistant, "tool_calls": [call]}]),
            tool_turns=renders([user, {**assistant, "tool_calls": [call]}], [user, {**assistant, "tool_calls": [call]}, tool]),
        )


def _limit_messages(spec: dict[str, Any], template: TemplateSupport) -> None:
    """Message fields this template does not render are refused at run time: null (or, for the
    tool role, absent) in the served spec."""
    message = spec["components"]["schemas"]["ChatMessage"]["properties"]
    if not template.names:
        message["name"] = {"type": "null", "description": "This model's chat template does not render names."}
    if not template.tool_calls:  # an empty list asks for nothing: accepted as null is
        message["tool_calls"] = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}],
                                 "description": "This model's chat template does not render tool calls."}  # fmt: skip
    if not template.tool_turns:
        message["role"]["enum"] = [role for role in message["role"]["enum"] if role != "tool"]
        message["tool_call_id"] = {"type": "null", "description": "This model's chat template does not render tool turns."}


def kv_cache_limits(stats: dict[str, Any]) -> dict[str, int] | None:
    """The KV cache a request's sequences must fit (``blocks`` of ``block_size`` tokens), from the
    engine's stats; None when the engine reports no paged cache."""
    if "kv_blocks_total" not in stats or "kv_block_size" not in stats:
        return None
    return {"blocks": int(stats["kv_blocks_total"]), "block_size": int(stats["kv_block_size"])}


def _without_chat(spec: dict[str, Any]) -> None:
    """A model without a chat template serves no chat: drop the routes of the endpoints that render
    conversations (chat, batch chat, the Responses API) and tokenize's chat form."""
    for endpoint in ENDPOINTS.values():
        if endpoint.chat:
            spec["paths"].pop(endpoint.route, None)
    schemas = spec["components"]["schemas"]
    schemas["TokenizeRequest"] = {"$ref": "#/components/schemas/TokenizeCompletionRequest"}


def _without_unserved_routes(spec: dict[str, Any], chat: bool, control_routes: bool, lora_routes: bool) -> None:
    """Leave out what this server does not serve: the control routes and the LoRA routes unless
    they were asked for, and without a chat template the endpoints that render conversations."""
    for route in (() if control_routes else CONTROL_ROUTES) + (() if lora_routes else LORA_ROUTES):
        spec["paths"].pop(route, None)
    if not chat:
        _without_chat(spec)


def deployment_spec(
    info: EngineInfo,
    model_names: list[str],
    extensions: dict[str, dict[str, Any]],
    chat: dict[str, int] | None,
    max_prompts: int | None = None,
    template: TemplateSupport = TemplateSupport(),
    max_seqs: int | None = None,
    kv_cache: dict[str, int] | None = None,
    unspellable: list[int] | None = None,
    responses_store: dict[str, float] | None = None,
    max_text_chars: int | None = None,
    max_request_tokens: int | None = None,
    control_routes: bool = False,
    lora_routes: bool = False,
) -> dict[str, Any]:
    """The spec served at ``/openapi.json``: what is valid there is valid for this server.

    ``x-limits`` publishes the bounds a fuzzer needs to keep clear of the runtime-only rules
    (``gyrfalcon.contract``); ``chat`` is :func:`chat_template_overhead`, ``unspellable``
    :func:`unspellable_bytes`; ``control_routes``: the RL control routes are served; ``lora_routes``:
    the LoRA routes are (an adapter's name is a model then: no enum of names, which adapters change).
    """
    unsupported = unsupported_fields(request_field_names(bundle()), info.capabilities)
    limits = ServedLimits(
        model_names=[] if lora_routes else model_names,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        max_request_seqs=max_seqs or info.max_request_seqs,
        max_logprobs=info.max_logprobs,
        unsupported=unsupported,
        extensions=bounded_extensions(extensions, info),
        max_prompts=max_prompts,
    )
    spec = served_spec(limits, served_table())
    _without_unserved_routes(spec, chat is not None, control_routes, lora_routes)
    if chat is not None:
        _limit_messages(spec, template)
    spec["x-limits"] = {
        "max_model_len": info.max_model_len,
        "vocab_size": info.vocab_size,
        "chat": chat,
        "max_request_seqs": max_seqs,
        "kv_cache": kv_cache,
        "unspellable_bytes": unspellable or [],
        # any body: refused before it is walked when it nests deeper, or holds more, than any field takes
        "body": {"max_depth": MAX_DEPTH, "max_array_items": longest_array(limits, SPEC_MAX_ITEMS),
                 "max_object_keys": largest_object(limits, SPEC_MAX_PROPERTIES)},
        # a prompt's text (or a conversation's): longer cannot fit the context (refused before tokenizing)
        "max_text_chars": max_text_chars,
        # prompts x n x max_tokens, a token with logprobs counting 1 + entries/20 (engine_api.lengths.request_work)
        "max_request_tokens": max_request_tokens,
        # a constraint (structured_outputs, response_format's schema) or a tool's parameters schema
        "constraints": {"max_bytes": MAX_CONSTRAINT_BYTES, "max_nodes": MAX_CONSTRAINT_NODES},
    }
    if responses_store is not None:  # the Responses API's stored responses: how many, how long
        spec["x-limits"]["responses_store"] = responses_store
    # what every logprob this server returns holds (--logprobs-mode)
    spec["x-logprobs-mode"] = {"mode": info.logprobs_mode, "description": LOGPROBS_MODES[info.logprobs_mode]}
    return spec
