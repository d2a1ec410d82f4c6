"""Cross-field rules of the protocol, by id, decided from the OpenAPI documents.

A rule JSON Schema can state is written once, in the documents: an ``if``/``then`` block carrying
its ``x-rule`` id, the refusal's text (``description``) and, where it is not the condition's first
field, the field the refusal names (``x-param``). Clients' validators and Schemathesis read the
same blocks; :func:`check_stated_rules` evaluates them, in the documents' order, after each field's
own checks and before the "not supported" check. The rules only the running server can decide are
in :mod:`gyrfalcon.protocol.runtime_rules`; a rule id has one of the two homes, never both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jsonschema

from gyrfalcon.errors import RequestError
from gyrfalcon.openapi.served import bundle, x_rules
from gyrfalcon.protocol.endpoints import CHAT, Endpoint, endpoint_of
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


def wire_param(endpoint: Endpoint | str, param: str | None) -> str | None:
    """An engine-side ``param`` as the client of ``endpoint`` wrote it (:meth:`Endpoint.wire_param`)."""
    return endpoint_of(endpoint).wire_param(param)


@dataclass(frozen=True)
class StatedRule:
    """One ``x-rule`` block of the documents: a value meeting ``condition`` must meet ``requirement``."""

    id: str
    #: the field its 400 names, within the object the block's schema describes
    param: str
    #: the 400's text (the block's ``description``)
    message: str
    condition: jsonschema.protocols.Validator
    requirement: jsonschema.protocols.Validator

    def broken_by(self, value: dict[str, Any]) -> bool:
        return self.condition.is_valid(value) and not self.requirement.is_valid(value)


@functools.cache
def stated_rules(schema: str) -> tuple[StatedRule, ...]:
    """The rule blocks of component schema ``schema`` (its ``allOf``), in the documents' order."""
    blocks = bundle()["components"]["schemas"][schema].get("allOf", [])
    validator = jsonschema.Draft202012Validator
    return tuple(StatedRule(block["x-rule"], block.get("x-param") or block["if"]["required"][0], block["description"],
                            validator(block["if"]), validator(block["then"]))
                 for block in blocks if "x-rule" in block)  # fmt: skip


def check_stated_rules(endpoint: Endpoint, sent: dict[str, Any], as_sent: bool = True) -> None:
    """A 400 for the first rule of the documents that ``sent`` (the fields a client set, nulls
    dropped) breaks: the rules of ``endpoint``'s request schema, then those of the object its
    sampling fields are nested in. ``as_sent`` False: ``sent`` is a request turned into a chat
    request (:mod:`gyrfalcon.protocol.responses`), held to chat's rules."""
    places = [((endpoint if as_sent else CHAT).wire_model.__name__, sent, None)]
    if as_sent and endpoint.nested_model is not None:
        places.append((endpoint.nested_model.__name__, sent.get(endpoint.nested), endpoint.nested))
    for schema, value, prefix in places:
        if not isinstance(value, dict):
            continue
        for rule in stated_rules(schema):
            if rule.broken_by(value):
                raise RequestError(rule.message, f"{prefix}.{rule.param}" if prefix else rule.param)


#: The runtime rules checked while a request is translated (their texts and homes:
#: :mod:`gyrfalcon.protocol.runtime_rules`).
TRANSLATION_RULES = translation_rule_ids()


def stated_rule_ids() -> list[str]:
    """Every ``x-rule`` id of the documents, once each, in the order they are first stated."""
    return list(dict.fromkeys(rule for _, rule in x_rules(bundle())))


def all_rule_ids() -> set[str]:
    return set(stated_rule_ids()) | set(TRANSLATION_RULES)
