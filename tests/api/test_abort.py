"""A client that disconnects mid-stream: the WSGI server closes the response iterable, the engine
frees the request's sequences within a few steps, and a concurrent request is unaffected."""

from __future__ import annotations

import threading
import time

import falcon.testing
import pytest

from gyrfalcon.api.app import create_app
from gyrfalcon.config import Settings
from gyrfalcon.plugins import plugin_manager
from gyrfalcon.plugins.engines import create_transformers_engine
from tests.conftest import tiny_settings


@pytest.fixture
def slow_engine(tiny_model_dir):
    engine = create_transformers_engine(tiny_settings(tiny_model_dir, max_model_len=256))
    assert engine.wait_ready(60).ready
    forward = engine.core.runner.forward

    def slowed(*args, **kwargs):  # a few ms per step, so requests are surely still running
        time.sleep(0.004)
        return forward(*args, **kwargs)

    engine.core.runner.forward = slowed
    yield engine
    engine.shutdown(0)


def test_stream_disconnect_frees_the_sequences(slow_engine, tiny_model_dir):
    engine = slow_engine
    app = create_app(engine, Settings(model=tiny_model_dir, served_model_name=["tiny"]), plugin_manager())
    client = falcon.testing.TestClient(app)
    body = {"prompt": "The quick brown fox", "max_tokens": 150, "temperature": 1.0, "n": 3,
            "ignore_eos": True, "stream": True}  # fmt: skip
    environ = falcon.testing.create_environ(path="/v1/completions", method="POST", body=falcon.testing.helpers.json.dumps(body),
                                            headers={"Content-Type": "application/json"})  # fmt: skip
    statuses = []
    result = app(environ, lambda status, headers, exc_info=None: statuses.append(status))
    chunks = iter(result)
    first = next(chunks)
    assert statuses == ["200 OK"] and first.startswith(b"data: ")

    other: dict = {}
    worker = threading.Thread(target=lambda: other.update(client.simulate_post(
        "/v1/completions", json={"prompt": "Hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True}).json))
    worker.start()
    deadline = time.monotonic() + 20
    while engine.stats()["running_sequences"] < 4:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.002)
    aborted, steps = engine.stats()["requests_aborted"], engine.stats()["decode_forwards"]
    result.close()  # what the WSGI server does when the client has gone
    while engine.stats()["requests_aborted"] == aborted:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert engine.stats()["decode_forwards"] - steps <= 3
    assert engine.stats()["running_sequences"] <= 1  # only the other request is left
    worker.join(20)
    choice = other["choices"][0]
    assert choice["finish_reason"] == "length" and other["usage"]["completion_tokens"] == 40
    alone = client.simulate_post("/v1/completions", json={"prompt": "Hello", "max_tokens": 40, "temperature": 0,
                                                         "ignore_eos": True}).json  # fmt: skip
    assert alone["choices"][0]["text"] == choice["text"]
