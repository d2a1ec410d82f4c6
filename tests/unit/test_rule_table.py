"""Every protocol rule has one home: stated in the documents (an ``x-rule`` if/then, which the server
evaluates) or the runtime-only table (a function); and the server's verdict on sample bodies is the
documents' own."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import gyrfalcon
from gyrfalcon.errors import Kind, RequestError
from gyrfalcon.openapi import bundle, rule_ids
from gyrfalcon.openapi.served import x_rules
from gyrfalcon.protocol.endpoints import endpoint_of
from gyrfalcon.protocol.rules import TRANSLATION_RULES, all_rule_ids, check_stated_rules, stated_rule_ids, stated_rules
from gyrfalcon.protocol.runtime_rules import RUNTIME_RULES
from tests.unit.test_spec import RULE_CASES

ENDPOINT_OF = {
    "GenerateRequest": "generate",
    "GenerateSamplingParams": "generate",
    "CompletionRequest": "completions",
    "ChatCompletionRequest": "chat",
    "BatchChatCompletionRequest": "chat_batch",
}


def test_every_rule_is_in_the_spec_or_the_runtime_table():
    in_spec = rule_ids(bundle())
    runtime = {rule.id for rule in RUNTIME_RULES}
    assert set(stated_rule_ids()) == in_spec
    assert set(TRANSLATION_RULES) <= runtime, "runtime-only rules are listed in the served table"
    assert all_rule_ids() <= in_spec | runtime


def test_every_rule_has_exactly_one_home():
    """A rule the documents state is decided from them alone: no id is both stated and in the
    runtime table, no function of the package is named after a stated rule, and no stated rule's
    refusal text is written again in the code (the documents hold it, as ``description``)."""
    stated = set(stated_rule_ids())
    assert not stated & {rule.id for rule in RUNTIME_RULES}
    package = Path(gyrfalcon.__file__).parent
    code = "\n".join(p.read_text() for p in package.rglob("*.py") if "generated" not in p.parts)
    for schema in {schema for schema, _ in x_rules(bundle())}:
        for rule in stated_rules(schema):
            assert rule.message and rule.message not in code, (schema, rule.id)
    assert not [rule for rule in stated if f"def {rule}(" in code]


def test_every_runtime_rule_names_a_home_that_exists():
    """A runtime rule's home is the function (or table) that decides it: renaming or removing it
    without mending the registry fails here."""
    assert len({rule.id for rule in RUNTIME_RULES}) == len(RUNTIME_RULES)
    for rule in RUNTIME_RULES:
        module_name, _, qualname = rule.home.partition(":")
        target = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part, None)
            assert target is not None, f"{rule.id}: {rule.home} does not exist"
        assert rule.stage in {"translation", "engine", "generation", "store"}, rule


CASES = [(rule, schema, body, valid) for rule, cases in RULE_CASES.items() for schema, body, valid in cases]


@pytest.mark.parametrize("rule,schema,body,valid", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_code_agrees_with_the_spec(rule, schema, body, valid):
    """The spec's if/then verdict on each sample body is also the protocol layer's verdict."""
    endpoint = endpoint_of(ENDPOINT_OF[schema])
    if schema == "GenerateSamplingParams":
        body = {"token_ids": [1], "sampling_params": body}
    sent = {k: v for k, v in body.items() if v is not None}  # (what the translator hands it: nulls dropped)
    if valid:
        check_stated_rules(endpoint, sent)
    else:
        with pytest.raises(RequestError) as info:
            check_stated_rules(endpoint, sent)
        assert info.value.type == Kind.INVALID and info.value.param
