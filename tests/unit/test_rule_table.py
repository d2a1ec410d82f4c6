"""Every protocol rule is stated in the spec (an ``x-rule`` if/then) or in the runtime-only table,
and the code and the spec agree on the same sample bodies."""

from __future__ import annotations

import importlib

import pytest

from gyrfalcon.errors import Kind, RequestError
from gyrfalcon.openapi import bundle, rule_ids
from gyrfalcon.protocol.rules import RULES, TRANSLATION_RULES, RequestFields, all_rule_ids, check_rules
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
    assert set(RULES) == in_spec, "rules JSON Schema can state are written as x-rule if/then blocks"
    assert set(TRANSLATION_RULES) <= runtime, "runtime-only rules are listed in the served table"
    assert all_rule_ids() <= in_spec | runtime


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
    endpoint = ENDPOINT_OF[schema]
    if schema == "GenerateSamplingParams":
        body = {"token_ids": [1], "sampling_params": body}
    fields = RequestFields.from_body(endpoint, body)
    if valid:
        check_rules(fields)
    else:
        with pytest.raises(RequestError) as info:
            check_rules(fields)
        assert info.value.type == Kind.INVALID and info.value.param
