"""Schemathesis over every operation of the served spec, positive and negative, all checks."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from gyrfalcon.contract import configure_schema


@pytest.fixture(scope="session")
def served_schema(fuzz_app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    return configure_schema(schema, max_examples=40)


schema = schemathesis.pytest.from_fixture("served_schema")


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_api_conforms_to_its_spec(case):
    case.call_and_validate()
