"""This deployment's served spec: the bundled documents with the engine's limits laid over them."""

from __future__ import annotations

import copy
from typing import Any

from gyrfalcon.engine.types import EngineInfo
from gyrfalcon.openapi.served import ServedLimits, bundle, request_field_names, served_spec
from gyrfalcon.protocol.capabilities import unsupported_fields

#: a plugin marks an integer schema of its extension fragment as a token id with this key
TOKEN_ID_MARK = "x-token-id"


def bounded_extensions(extensions: dict[str, dict[str, Any]], info: EngineInfo) -> dict[str, dict[str, Any]]:
    """The plugins' extension fragments with every ``x-token-id`` integer capped below the vocabulary."""
    bounded = copy.deepcopy(extensions)

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if node.get(TOKEN_ID_MARK) is True:
                node["maximum"] = min(node.get("maximum", info.vocab_size - 1), info.vocab_size - 1)
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(bounded)
    return bounded


def deployment_spec(info: EngineInfo, model_names: list[str], extensions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The spec served at ``/openapi.json``: what is valid there is valid for this server."""
    unsupported = unsupported_fields(request_field_names(bundle()), info.capabilities)
    limits = ServedLimits(
        model_names=model_names,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        max_num_seqs=info.max_num_seqs,
        max_logprobs=info.max_logprobs,
        unsupported=unsupported,
        extensions=bounded_extensions(extensions, info),
    )
    return served_spec(limits)
