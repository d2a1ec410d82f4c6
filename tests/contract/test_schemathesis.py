"""Schemathesis over every operation of the served spec, positive and negative, all checks."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from gyrfalcon.contract import configure_schema
from gyrfalcon.protocol.endpoints import CONTROL_ROUTES, LORA_ROUTES


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
    return configure_schema(schema, max_examples=40)


# (filtered here: a filter on the fixture's schema is not applied to the lazy schema's operations)
control = schemathesis.pytest.from_fixture("control_schema").include(path=list(CONTROL_ROUTES))


@control.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_the_control_routes_conform_to_their_spec(case):
    case.call_and_validate()


@pytest.fixture
def lora_schema(lora_app):
    """The LoRA routes and the model list they change, on an app that serves them."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", lora_app)
    return configure_schema(schema, max_examples=40)


lora = schemathesis.pytest.from_fixture("lora_schema").include(path=[*LORA_ROUTES, "/v1/models"])


@lora.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_the_lora_routes_conform_to_their_spec(case):
    case.call_and_validate()
