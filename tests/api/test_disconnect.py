"""A non-streaming client that hangs up is noticed, and its sequences are freed in the engine."""

from __future__ import annotations

import socket
import time

import falcon.testing
import pytest

from gyrfalcon.errors import RequestError
from gyrfalcon.protocol.translate import Translator
from gyrfalcon.serving.runner import CLIENT_CLOSED, complete, submit_all


def test_client_alive_peeks_at_the_gunicorn_socket():
    from gyrfalcon.api.resources import client_alive

    ours, theirs = socket.socketpair()
    try:
        req = falcon.testing.create_req(path="/v1/completions")
        assert client_alive(req) is None  # no socket: cannot tell, never aborts
        req.env["gunicorn.socket"] = ours
        alive = client_alive(req)
        assert alive() is True
        theirs.close()
        assert alive() is False
    finally:
        ours.close()


def test_gone_client_aborts_its_request(tiny_engine):
    translator = Translator(tiny_engine, ["tiny"], {})
    serving = translator.translate("completions", {"prompt": "x", "max_tokens": 100, "n": 4, "ignore_eos": True, "seed": 1})
    before = tiny_engine.stats()["requests_aborted"]
    streams = submit_all(tiny_engine, serving)
    started = time.monotonic()
    with pytest.raises(RequestError) as info:
        complete(tiny_engine, serving, streams, client_alive=lambda: False, poll_s=0.001)
    assert info.value.status == CLIENT_CLOSED
    deadline = time.monotonic() + 10
    while tiny_engine.stats()["requests_aborted"] == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tiny_engine.stats()["requests_aborted"] == before + 1
    assert time.monotonic() - started < 10
