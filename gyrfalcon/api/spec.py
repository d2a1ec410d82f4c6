"""This deployment's served spec: the bundled documents with the engine's limits laid over them."""

from __future__ import annotations

import copy
from typing import Any

from gyrfalcon.engine_api.interface import Engine
from gyrfalcon.engine_api.types import EngineInfo
from gyrfalcon.openapi.served import ServedLimits, bundle, request_field_names, served_spec, walk_schemas
from gyrfalcon.protocol.capabilities import unsupported_fields

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


def template_renders_names(engine: Engine) -> bool:
    """Whether the chat template renders a message's ``name`` (else ``name`` is refused)."""
    message = {"role": "user", "content": "x"}
    try:
        plain = engine.apply_chat_template([message], True)
        return engine.apply_chat_template([{**message, "name": "someone"}], True) != plain
    except Exception:  # noqa: BLE001 - no usable template
        return False


def kv_cache_limits(stats: dict[str, Any]) -> dict[str, int] | None:
    """The KV cache a request's sequences must fit (``blocks`` of ``block_size`` tokens), from the
    engine's stats; None when the engine reports no paged cache."""
    if "kv_blocks_total" not in stats or "kv_block_size" not in stats:
        return None
    return {"blocks": int(stats["kv_blocks_total"]), "block_size": int(stats["kv_block_size"])}


CHAT_PATHS = ("/v1/chat/completions", "/v1/chat/completions/batch")


def _without_chat(spec: dict[str, Any]) -> None:
    """A model without a chat template serves no chat: drop the chat routes and tokenize's chat form."""
    for path in CHAT_PATHS:
        spec["paths"].pop(path, None)
    schemas = spec["components"]["schemas"]
    schemas["TokenizeRequest"] = {"$ref": "#/components/schemas/TokenizeCompletionRequest"}


def deployment_spec(
    info: EngineInfo,
    model_names: list[str],
    extensions: dict[str, dict[str, Any]],
    chat: dict[str, int] | None,
    max_prompts: int | None = None,
    names: bool = True,
    max_seqs: int | None = None,
    kv_cache: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The spec served at ``/openapi.json``: what is valid there is valid for this server.

    ``x-limits`` publishes the bounds a fuzzer needs to keep clear of the runtime-only rules
    (``gyrfalcon.contract``); ``chat`` is :func:`chat_template_overhead`.
    """
    unsupported = unsupported_fields(request_field_names(bundle()), info.capabilities)
    limits = ServedLimits(
        model_names=model_names,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        max_request_seqs=max_seqs or info.max_request_seqs,
        max_logprobs=info.max_logprobs,
        unsupported=unsupported,
        extensions=bounded_extensions(extensions, info),
        max_prompts=max_prompts,
    )
    spec = served_spec(limits)
    if chat is None:
        _without_chat(spec)
    if not names:  # the template ignores message names: refused at run time, so absent (or null) here
        spec["components"]["schemas"]["ChatMessage"]["properties"]["name"] = {
            "type": "null", "description": "This model's chat template does not render names."
        }
    spec["x-limits"] = {
        "max_model_len": info.max_model_len,
        "vocab_size": info.vocab_size,
        "chat": chat,
        "max_request_seqs": max_seqs,
        "kv_cache": kv_cache,
    }
    return spec
