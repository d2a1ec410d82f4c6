"""In-process API tests: the Falcon app around the real engine on the tiny model."""

from __future__ import annotations

import time

import falcon.testing
import pytest

from gyrfalcon.config import Settings
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.conftest import tiny_settings
from tests.helpers import api_client, served_app


@pytest.fixture(scope="session")
def app(tiny_engine, tiny_model_dir):
    settings = Settings(model=str(tiny_model_dir), served_model_name=["tiny"], max_body_bytes=64 * 1024)
    return served_app(tiny_engine, settings)


@pytest.fixture
def client(app) -> falcon.testing.TestClient:
    return api_client(app)


@pytest.fixture
def slow_engine(tiny_model_dir, request):
    """The tiny model's engine with a few ms added to every forward (``@pytest.mark.parametrize``
    ``slow_engine`` indirectly with the delay in seconds), so requests are surely still running."""
    delay = getattr(request, "param", 0.004)
    engine = create_transformers_engine(tiny_settings(tiny_model_dir, max_model_len=256))
    assert engine.wait_ready(60).ready
    forward = engine.core.runner.step

    def slowed(*args, **kwargs):
        time.sleep(delay)
        return forward(*args, **kwargs)

    engine.core.runner.step = slowed
    yield engine
    engine.shutdown(0)
