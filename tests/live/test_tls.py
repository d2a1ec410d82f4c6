"""``--ssl-keyfile`` / ``--ssl-certfile``: the server speaks HTTPS only."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import requests

from tests.live_server import start_server, stop_server

pytestmark = pytest.mark.live


def test_https_with_a_certificate(tiny_model_dir, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)  # fmt: skip
    server = start_server(["--model", tiny_model_dir, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)],
                          str(tmp_path / "server.log"), scheme="https")  # fmt: skip
    try:
        r = requests.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2, "temperature": 1},
                          verify=str(cert), timeout=30)  # fmt: skip
        assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1]
        with pytest.raises(requests.ConnectionError):  # plain HTTP is not spoken on that port
            requests.get(server.url.replace("https://", "http://") + "/health", timeout=5)
        # gyrfalcon check over HTTPS: a self-signed certificate is an error unless --insecure
        from gyrfalcon.check import Outcome, Target, run_check, selected

        one = selected(["models"])[0]
        assert run_check(Target(server.url, model_name="tiny"), one).outcome is Outcome.ERROR
        assert run_check(Target(server.url, insecure=True), one).outcome is Outcome.PASSED
        # SIGTERM while a client holds an idle keep-alive connection: the worker stops in seconds,
        # not after the 30 s a TLS close waits for a close_notify that such a client never sends
        idle = requests.Session()
        assert idle.get(server.url + "/health", verify=str(cert), timeout=30).status_code == 200
        started = time.monotonic()
        os.killpg(server.process.pid, signal.SIGTERM)
        server.process.wait(timeout=30)
        assert time.monotonic() - started < 10, f"stopped {time.monotonic() - started:.1f} s after SIGTERM"
    finally:
        stop_server(server)
