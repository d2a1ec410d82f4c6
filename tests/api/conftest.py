"""In-process API tests: the Falcon app around the real engine on the tiny model."""

from __future__ import annotations

import falcon.testing
import pytest

from gyrfalcon.api.app import create_app
from gyrfalcon.config import Settings
from gyrfalcon.plugins import plugin_manager


@pytest.fixture(scope="session")
def app(tiny_engine, tiny_model_dir):
    settings = Settings(model=str(tiny_model_dir), served_model_name=["tiny"], max_body_bytes=64 * 1024)
    return create_app(tiny_engine, settings, plugin_manager())


@pytest.fixture
def client(app) -> falcon.testing.TestClient:
    return falcon.testing.TestClient(app)
