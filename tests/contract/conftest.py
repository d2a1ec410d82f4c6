"""Contract tests: Schemathesis against the served spec of an app with small limits."""

from __future__ import annotations

import dataclasses

import pytest

from gyrfalcon.plugins import plugin_manager
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.helpers import served_app
from tests.conftest import tiny_settings

#: small limits keep every valid request fast and deterministic under fuzzing
FUZZ_LIMITS = {"max_model_len": 64, "max_num_seqs": 8, "served_model_name": ["tiny"]}


@pytest.fixture(scope="session")
def fuzz_engine(tiny_model_dir, tmp_path_factory):
    """The fuzzed apps' engine, its settings and plugins."""
    # the Responses API's store in a folder of its own
    settings = tiny_settings(tiny_model_dir, **FUZZ_LIMITS, cache_dir=str(tmp_path_factory.mktemp("fuzz-cache")))
    pm = plugin_manager()
    engine = create_transformers_engine(settings, pm)
    assert engine.wait_ready(timeout=120).ready
    yield engine, settings, pm
    engine.shutdown(grace=1.0)


@pytest.fixture(scope="session")
def fuzz_app(fuzz_engine):
    engine, settings, pm = fuzz_engine
    return served_app(engine, settings, pm)


@pytest.fixture
def control_app(fuzz_engine):
    """An app serving the RL control routes over the fuzzed engine; generation runs again after."""
    engine, settings, pm = fuzz_engine
    yield served_app(engine, dataclasses.replace(settings, enable_rl_endpoints=True), pm)
    engine.resume()


@pytest.fixture(scope="session")
def lora_app(tiny_model_dir, tmp_path_factory):
    """An app serving the LoRA routes (an engine of its own, with one adapter held of two)."""
    from tests.unit.test_lora import write_adapter

    adapter = write_adapter(tiny_model_dir, tmp_path_factory.mktemp("fuzz-adapter") / "first", seed=1)
    settings = tiny_settings(tiny_model_dir, **FUZZ_LIMITS, enable_lora=True, lora_modules=[f"first={adapter}"],
                             max_loras=2, cache_dir=str(tmp_path_factory.mktemp("lora-cache")))  # fmt: skip
    engine = create_transformers_engine(settings)
    assert engine.wait_ready(timeout=120).ready
    yield served_app(engine, settings)
    engine.shutdown(grace=1.0)
