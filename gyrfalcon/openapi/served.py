"""The one served spec: the OpenAPI documents bundled, with this deployment's limits laid over them.

``bundle()`` merges ``common.yaml``, ``generate.yaml`` and ``openai.yaml`` into one OpenAPI 3.1
document (cross-file ``$ref``s rewritten to local ones). ``served_spec(limits)`` lays a
:class:`ServedLimits` over it (the field bounds of :data:`gyrfalcon.openapi.limits.FIELD_LIMITS`, which the
translator enforces too) so that a fuzzer's "valid" request is valid for this server, and adds
``x-runtime-rules``: the rules JSON Schema cannot state (:data:`RUNTIME_RULES`).

Pure Python (PyYAML only): importable by the HTTP frontend without torch.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from gyrfalcon.openapi.limits import ServedLimits, limits_of

OPENAPI_DIR = Path(__file__).resolve().parent
#: The source documents, in bundling order (shared components first).
DOCUMENTS = ("common.yaml", "generate.yaml", "openai.yaml")
_COMPONENT_SECTIONS = ("schemas", "responses", "headers", "parameters", "requestBodies", "securitySchemes")

#: Rules the protocol layer enforces in code that the served spec cannot state as ``if``/``then``
#: (each is a 400 carrying ``param``). The cross-field rules stated in the spec carry ``x-rule`` ids
#: (see :func:`rule_ids`); together the two lists cover every protocol rule.
RUNTIME_RULES: tuple[dict[str, str], ...] = (
    {
        "id": "min_tokens_le_max_tokens",
        "param": "min_tokens",
        "description": "min_tokens must not exceed the effective max_tokens "
        "(max_completion_tokens on chat wins over max_tokens; completions default 16).",
    },
    {
        "id": "prompt_fits_context",
        "param": "prompt",
        "description": "prompt tokens + max_tokens <= max_model_len. param is the prompt field of the "
        "endpoint: token_ids (generate), prompt (completions), messages (chat, batch chat). An omitted "
        "max_tokens on chat, batch chat and generate means up to the context, so there the prompt alone "
        "must leave room for one token.",
    },
    {
        "id": "request_fits_kv_cache",
        "param": "max_tokens",
        "description": "n x (prompt + max_tokens), in whole blocks, fits the server's KV cache (x-limits "
        "kv_cache), so that the request can run even alone; param is the prompt field when the prompt "
        "alone does not fit.",
    },
    {
        "id": "continue_final_message_alone",
        "param": "continue_final_message",
        "description": "continue_final_message: true needs add_generation_prompt: false (vLLM's rule).",
    },
    {
        "id": "request_seqs_le_limit",
        "param": "n",
        "description": "prompts (or conversations) x n <= the server's max_request_seqs (x-limits), so "
        "that one request cannot hold the server for long.",
    },
    {
        "id": "prompt_not_empty_after_tokenization",
        "param": "prompt",
        "description": "A non-empty prompt string must tokenize to at least one token (byte-level "
        "tokenizers always do; others may drop some text).",
    },
    {
        "id": "constraint_compiles",
        "param": "structured_outputs",
        "description": "A structured_outputs constraint sets exactly one kind, not together with a "
        "response_format other than text, and its JSON schema, regex or grammar compiles; param names "
        "the field (structured_outputs.<kind>, or response_format.json_schema.schema).",
    },
    {
        "id": "tools_consistent",
        "param": "tool_choice",
        "description": "tool_choice other than none needs tools; a named function must be among them; tool "
        "names are distinct (param tools); required or a named function cannot join response_format or "
        "structured_outputs, and the called tools' parameters schemas must compile (param tools); every tool's "
        "parameters is a valid JSON Schema (its draft's meta-schema, 2020-12 by default), whatever tool_choice is "
        "(param tools.<i>.function.parameters).",
    },
    {
        "id": "constraints_leave_a_token",
        "param": "structured_outputs",
        "description": "The request's token-excluding constraints together (structured_outputs, "
        "response_format or a required tool call; allowed_token_ids; bad_words; min_tokens) leave at least "
        "one token at every step. Whether they do is known only while generating: a row left with no token "
        "ends with a 400 naming the most specific of them (in band when it is not the first token). A constraint "
        "holding a character with a byte no token holds (x-limits unspellable_bytes) may meet this rule.",
    },
    {
        "id": "message_name_rendered",
        "param": "messages",
        "description": "A message name is refused when the model's chat template does not render it "
        "(it would be accepted and ignored).",
    },
    {
        "id": "message_fields_match_role",
        "param": "messages",
        "description": "content is required except on assistant turns; tool_calls and reasoning_content "
        "belong to assistant turns; tool_call_id is required on tool turns and only there. param names the "
        "message field (messages.<i>.<field>).",
    },
    {
        "id": "tool_call_arguments_json",
        "param": "messages",
        "description": "A tool call's function.arguments is a JSON text (the template receives it parsed).",
    },
    {
        "id": "message_tool_calls_rendered",
        "param": "messages",
        "description": "Assistant tool_calls are refused when the model's chat template does not render "
        "them (they would be ignored); the served spec then states tool_calls as null.",
    },
    {
        "id": "logit_bias_ids_in_vocab",
        "param": "logit_bias",
        "description": "Every logit_bias key is a token id below the vocabulary size "
        "(the served spec also narrows its propertyNames pattern).",
    },
    {
        "id": "chat_template_renders",
        "param": "messages",
        "description": "The model's chat template renders the conversation (e.g. role order it accepts).",
    },
    {
        "id": "token_ids_in_vocab",
        "param": "token_ids",
        "description": "Every token id (token_ids, prompt ids, stop_token_ids, allowed_token_ids, "
        "logprob_token_ids) is below the vocabulary size; param names the field. Stated in the served "
        "spec as maximum, enforced in code because the generated models carry no deployment limits.",
    },
    {
        "id": "logprob_token_ids_unique",
        "param": "logprob_token_ids",
        "description": "No duplicate ids (uniqueItems in the spec; the generated models do not check it).",
    },
    {
        "id": "logprobs_le_max_logprobs",
        "param": "logprobs",
        "description": "logprobs, top_logprobs and prompt_logprobs <= the server's max_logprobs "
        "(stated in the served spec as maximum); param names the field.",
    },
    {
        "id": "model_served",
        "param": "model",
        "description": "model, when given, is a served model name (404 otherwise; enum in the served spec).",
    },
    {
        "id": "field_supported",
        "param": "<field>",
        "description": "A field the engine cannot honour is rejected unless it holds its wire default "
        "(const/not in the served spec); checked after schema and cross-field rules.",
    },
    {
        "id": "extensions_valid",
        "param": "extensions",
        "description": "Each extensions property is validated by the plugin that declared it.",
    },
    {
        "id": "previous_response_stored",
        "param": "previous_response_id",
        "description": "previous_response_id names a response this server stores (stored with store true, not "
        "deleted, within x-limits responses_store: size and ttl_s); else a 404 naming it, which says when the "
        "response was evicted.",
    },
    {
        "id": "background_stored_not_streamed",
        "param": "background",
        "description": "background true needs store true (param background) and stream false (param stream).",
    },
    {
        "id": "responses_supported",
        "param": "<field>",
        "description": "On /v1/responses, reasoning (no reasoning template), truncation auto, hosted tools "
        "(param tools.<i>.type) and every include but message.output_text.logprobs (param include.<i>) are refused.",
    },
)


def _load(name: str) -> dict[str, Any]:
    with (OPENAPI_DIR / name).open() as f:
        # The JSON round trip drops YAML aliases (shared objects) so that callers may edit in place.
        return json.loads(json.dumps(yaml.safe_load(f)))


def _localise_refs(node: Any) -> Any:
    """Rewrite ``other.yaml#/x`` references to ``#/x`` (every document is merged into one)."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and "#" in value:
                value = "#" + value.split("#", 1)[1]
            out[key] = _localise_refs(value)
        return out
    if isinstance(node, list):
        return [_localise_refs(v) for v in node]
    return node


@lru_cache(maxsize=1)
def _bundle_json() -> str:
    from gyrfalcon import __version__

    docs = {name: _localise_refs(_load(name)) for name in DOCUMENTS}
    spec: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "gyrfalcon",
            "version": __version__,
            "description": "\n\n".join(d["info"].get("description", "") for d in docs.values()).strip(),
        },
        "paths": {},
        "components": {},
    }
    for name, doc in docs.items():
        for path, item in doc.get("paths", {}).items():
            if path in spec["paths"]:
                raise ValueError(f"{name}: path {path} is already defined by another document")
            spec["paths"][path] = item
        for section, entries in doc.get("components", {}).items():
            if section not in _COMPONENT_SECTIONS:
                raise ValueError(f"{name}: unexpected components section {section!r}")
            target = spec["components"].setdefault(section, {})
            for key, value in entries.items():
                if key in target and target[key] != value:
                    raise ValueError(f"{name}: components/{section}/{key} differs from another document's")
                target[key] = value
    return json.dumps(spec)


def bundle() -> dict[str, Any]:
    """The documents merged into one OpenAPI 3.1 document (a fresh copy on every call)."""
    return json.loads(_bundle_json())


def _schema_of_ref(spec: dict[str, Any], ref: str) -> tuple[str, dict[str, Any]]:
    prefix = "#/components/schemas/"
    if not ref.startswith(prefix):
        raise ValueError(f"unexpected $ref {ref!r}")
    name = ref[len(prefix) :]
    return name, spec["components"]["schemas"][name]


def request_schema_names(spec: dict[str, Any]) -> list[str]:
    """Names of the component schemas reachable from any request body (``if``/``then`` not followed)."""
    seen: list[str] = []

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                name, target = _schema_of_ref(spec, node["$ref"])
                if name not in seen:
                    seen.append(name)
                    visit(target)
            for key, value in node.items():
                if key not in ("if", "then", "else", "not", "$ref"):
                    visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    for item in spec["paths"].values():
        for operation in item.values():
            if isinstance(operation, dict) and "requestBody" in operation:
                for media in operation["requestBody"]["content"].values():
                    visit(media["schema"])
    return seen


def request_field_names(spec: dict[str, Any]) -> set[str]:
    """Every property name of every request schema (the names ``ServedLimits.unsupported`` may use)."""
    schemas = spec["components"]["schemas"]
    return {p for name in request_schema_names(spec) for p in schemas[name].get("properties", {})}


def _overlay_property(name: str, schema: dict[str, Any], limits: ServedLimits) -> dict[str, Any]:
    if name == "model" and limits.model_names:
        # null is "not set" (the first served model): it stays valid where the wire allows it
        schema["enum"] = [*limits.model_names, *([None] if _is_nullable(schema) else [])]
    for limit in limits_of(name):  # the one table of field bounds, which the translator enforces too
        limit.bound_schema(schema, limits)
    if name in limits.unsupported:
        # null means "not set" where the wire allows it, so it stays allowed
        nullable = _is_nullable(schema)
        if "default" in schema:
            if nullable and schema["default"] is not None:
                schema["enum"] = [schema["default"], None]
            else:
                schema["const"] = schema["default"]
            schema["description"] = (schema.get("description", "") + " Not supported here: only the default.").strip()
        elif nullable:
            schema = {"type": "null", "description": "Not supported by this server: absent or null."}
        else:
            schema = {"not": {}, "description": "Not supported by this server: must be absent."}
    return schema


def _is_nullable(schema: dict[str, Any]) -> bool:
    types = schema.get("type")
    if types == "null" or (isinstance(types, list) and "null" in types):
        return True
    return any(isinstance(v, dict) and v.get("type") == "null" for v in schema.get("oneOf", []) + schema.get("anyOf", []))


def served_spec(limits: ServedLimits) -> dict[str, Any]:
    """The bundle with ``limits`` laid over every request schema, plus ``x-runtime-rules``.

    - ``model``: ``enum`` of the served names; ``n``: ``maximum`` max_request_seqs (batch chat stays 1);
      ``max_tokens``/``max_completion_tokens``: ``maximum`` max_model_len - 1;
    - every token-id integer: ``maximum`` vocab_size - 1; ``logit_bias`` keys: ids below vocab_size;
    - prompt id arrays (``token_ids``, ``prompt``): ``maxItems`` max_model_len; ``min_tokens``:
      ``maximum`` max_model_len - 1 (sound bounds; the exact ones are runtime rules);
    - integer logprob counts (``logprobs``, ``top_logprobs``, ``prompt_logprobs``): ``maximum`` max_logprobs;
    - unsupported fields: ``const: <default>`` where the wire schema has a default, else ``not: {}``;
    - ``Extensions``: ``properties`` = the plugins' fragments (still ``additionalProperties: false``).

    Only the properties of request schemas are touched; ``if``/``then`` rule blocks stay as written.
    """
    spec = bundle()
    schemas = spec["components"]["schemas"]
    for name in request_schema_names(spec):
        props = schemas[name].get("properties", {})
        for prop in list(props):
            props[prop] = _overlay_property(prop, props[prop], limits)
    if limits.extensions:
        schemas["Extensions"]["properties"] = copy.deepcopy(limits.extensions)
    spec["x-runtime-rules"] = [dict(rule) for rule in RUNTIME_RULES]
    return spec


def x_rules(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """``(component schema name, x-rule id)`` for every ``if``/``then`` rule block in ``spec``."""
    found: list[tuple[str, str]] = []

    def visit(owner: str, node: Any) -> None:
        if isinstance(node, dict):
            if "x-rule" in node:
                found.append((owner, node["x-rule"]))
            for value in node.values():
                visit(owner, value)
        elif isinstance(node, list):
            for value in node:
                visit(owner, value)

    for name, schema in spec["components"]["schemas"].items():
        visit(name, schema)
    return found


def rule_ids(spec: dict[str, Any]) -> set[str]:
    """The set of ``x-rule`` ids stated in ``spec`` (compare with the protocol layer's rules)."""
    return {rule for _, rule in x_rules(spec)}
