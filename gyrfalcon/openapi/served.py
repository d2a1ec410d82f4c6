"""The one served spec: the OpenAPI documents bundled, with this deployment's limits laid over them.

``bundle()`` merges ``common.yaml``, ``generate.yaml`` and ``openai.yaml`` into one OpenAPI 3.1
document (cross-file ``$ref``s rewritten to local ones). ``served_spec(limits)`` lays a
:class:`ServedLimits` over it (the field bounds of :data:`gyrfalcon.openapi.limits.FIELD_LIMITS`, which the
translator enforces too) so that a fuzzer's "valid" request is valid for this server, and adds
``x-runtime-rules``: the rules JSON Schema cannot state, from the protocol's registry
(:mod:`gyrfalcon.protocol.runtime_rules`), which the caller passes in.

Pure Python (PyYAML only): importable by the HTTP frontend without torch.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import yaml

from gyrfalcon.engine_api.limits import ServedLimits, limits_of
from gyrfalcon.openapi.limits import bound_schema, walk_schemas

OPENAPI_DIR = Path(__file__).resolve().parent
#: The source documents, in bundling order (shared components first).
DOCUMENTS = ("common.yaml", "generate.yaml", "openai.yaml")
_COMPONENT_SECTIONS = ("schemas", "responses", "headers", "parameters", "requestBodies", "securitySchemes")

def _load(name: str, directory: str) -> dict[str, Any]:
    with (Path(directory) / name).open() as f:
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


@lru_cache(maxsize=2)
def _bundle_json(directory: str = str(OPENAPI_DIR)) -> str:
    from gyrfalcon import __version__

    docs = {name: _localise_refs(_load(name, directory)) for name in DOCUMENTS}
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


def bundle(directory: Path = OPENAPI_DIR) -> dict[str, Any]:
    """The documents (of ``directory``: the package's own by default) merged into one OpenAPI 3.1
    document (a fresh copy on every call)."""
    return json.loads(_bundle_json(str(Path(directory).resolve())))


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


#: the validation keywords of a request field that the engine's policies read (``engine_api/limits.py``)
FIELD_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems", "uniqueItems")


def request_field_keywords(spec: dict[str, Any]) -> dict[str, dict[str, Any] | None]:
    """Each request field's :data:`FIELD_KEYWORDS` as the documents state them (its items' not
    included); None for a field the documents bound differently in two request schemas."""
    return _merged(spec, lambda prop: {k: prop[k] for k in FIELD_KEYWORDS if k in prop})


#: the keywords of a request field's string items that :func:`request_item_keywords` gathers
ITEM_KEYWORDS = ("minLength", "maxLength")


def request_item_keywords(spec: dict[str, Any]) -> dict[str, dict[str, Any] | None]:
    """Each request field whose array items (in the field itself or in one of its ``oneOf`` or
    ``anyOf`` branches) the documents bound with :data:`ITEM_KEYWORDS`: those keywords; None for a
    field two request schemas bound differently. Fields with none are left out."""
    found = _merged(spec, _item_keywords)
    return {name: keywords for name, keywords in found.items() if keywords != {}}


def _item_keywords(prop: dict[str, Any]) -> dict[str, Any]:
    keywords = {}
    for branch in (prop, *prop.get("oneOf", ()), *prop.get("anyOf", ())):
        items = branch.get("items") if isinstance(branch, dict) else None
        if isinstance(items, dict):
            keywords.update({k: items[k] for k in ITEM_KEYWORDS if k in items})
    return keywords


def _merged(spec: dict[str, Any], keywords_of: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    """``keywords_of`` each property of every request schema, by property name, sorted; None for a
    name two schemas give different keywords."""
    schemas = spec["components"]["schemas"]
    found: dict[str, dict[str, Any] | None] = {}
    for schema_name in request_schema_names(spec):
        for name, prop in sorted(schemas[schema_name].get("properties", {}).items()):
            keywords = keywords_of(prop)
            if name in found and found[name] != keywords:
                found[name] = None
            else:
                found.setdefault(name, keywords)
    return dict(sorted(found.items()))


def request_field_names(spec: dict[str, Any]) -> set[str]:
    """Every property name of every request schema (the names ``ServedLimits.unsupported`` may use)."""
    schemas = spec["components"]["schemas"]
    return {p for name in request_schema_names(spec) for p in schemas[name].get("properties", {})}


def _overlay_property(name: str, schema: dict[str, Any], limits: ServedLimits) -> dict[str, Any]:
    if name == "model" and limits.model_names:
        # null is "not set" (the first served model): it stays valid where the wire allows it
        schema["enum"] = [*limits.model_names, *([None] if _is_nullable(schema) else [])]
    for limit in limits_of(name):  # the one table of field bounds, which the translator enforces too
        bound_schema(limit, schema, limits)
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


def served_spec(limits: ServedLimits, runtime_rules: Sequence[Mapping[str, str]] = ()) -> dict[str, Any]:
    """The bundle with ``limits`` laid over every request schema, plus ``x-runtime-rules``: the
    rules JSON Schema cannot state, as the protocol's registry lists them
    (:func:`gyrfalcon.protocol.runtime_rules.served_table`).

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
    spec["x-runtime-rules"] = [dict(rule) for rule in runtime_rules]
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


def spec_max(keyword: str) -> int:
    """The largest fixed value of ``keyword`` (``maxItems``, ``maxProperties``) of any request schema
    in the documents: an array or object beyond every field's is refused before a body is walked."""
    spec = bundle()
    schemas = spec["components"]["schemas"]
    return max(sub[keyword] for name in request_schema_names(spec) for sub in walk_schemas(schemas[name])
               if isinstance(sub.get(keyword), int))  # fmt: skip


def fields_stating(keyword: str) -> dict[str, Any]:
    """The request fields whose schema states ``keyword`` (one the generated models do not
    enforce, such as ``maxProperties`` or ``uniqueItems``), with its value: the documents are the
    one home of these bounds."""
    spec = bundle()
    schemas = spec["components"]["schemas"]
    return {prop: schema[keyword] for name in request_schema_names(spec)
            for prop, schema in schemas[name].get("properties", {}).items() if keyword in schema}  # fmt: skip
