"""Schemathesis over every operation of the served spec, positive and negative, all checks."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from gyrfalcon.contract import configure_schema
from gyrfalcon.protocol.endpoints import CONTROL_ROUTES


@pytest.fixture(scope="session")
def served_schema(fuzz_app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    return configure_schema(schema, max_examples=40)


schema = schemathesis.pytest.from_fixture("served_schema")


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_api_conforms_to_its_spec(case):
    case.call_and_validate()


@pytest.fixture
def control_schema(control_app):
    """The RL control routes alone: a fuzzed pause would hold every other operation's requests."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", control_app)
    return configure_schema(schema, max_examples=40).include(path=list(CONTROL_ROUTES))


control = schemathesis.pytest.from_fixture("control_schema")


@control.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_the_control_routes_conform_to_their_spec(case):
    case.call_and_validate()
