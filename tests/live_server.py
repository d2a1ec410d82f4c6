"""A gyrfalcon server under gunicorn in a subprocess, started exactly as a user would start it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-5000:]


#: what a server's log says when the free port it was given was taken before it bound it
PORT_TAKEN = ("Address already in use", "Failed to bind to address")


def start_server(args: list[str], log_path: str, timeout: float = 180.0, env: dict[str, str] | None = None,
                 scheme: str = "http") -> LiveServer:  # fmt: skip
    """Run ``gyrfalcon serve ARGS --port <free> --enforce-eager`` and wait until ``/health`` answers 200.

    Test servers run eagerly: compiling the decode step takes seconds to minutes at each start
    (``tests/unit/test_decode_path.py`` tests the compiled path once).

    Read time-outs and refused connections while gunicorn boots are expected; the server is
    killed if it exits or is not healthy within ``timeout`` seconds. ``env`` adds variables;
    ``scheme`` is "https" for a server started with a certificate (not verified by the health poll).
    A server that exits because its port was taken meanwhile (Ray's own processes take ports of
    the same ephemeral range before its proxy binds: a clean-clone run lost its Ray module so) is
    started again on another port, up to three times.
    """
    for attempt in range(3):
        try:
            return _start_on_a_free_port(args, log_path, timeout, env, scheme)
        except RuntimeError as exc:
            if attempt == 2 or not any(text in str(exc) for text in PORT_TAKEN):
                raise
    raise AssertionError("unreachable")


def _start_on_a_free_port(args: list[str], log_path: str, timeout: float, env: dict[str, str] | None,
                          scheme: str) -> LiveServer:  # fmt: skip
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(env or {}))
    log = open(log_path, "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "gyrfalcon.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", *args],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    server = LiveServer(f"{scheme}://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            with warnings.catch_warnings():  # a test certificate is not verified while polling
                warnings.simplefilter("ignore")
                healthy = requests.get(server.url + "/health", timeout=2, verify=False).status_code == 200
            if healthy:
                return server
        except requests.RequestException:
            pass
        time.sleep(0.3)
    stop_server(server)
    raise RuntimeError(f"server not healthy after {timeout} s:\n{server.log()}")


def stop_server(server: LiveServer) -> None:
    """SIGTERM the whole process group (gunicorn master and workers), then SIGKILL if needed."""
    try:
        os.killpg(server.process.pid, signal.SIGTERM)
        server.process.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(server.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.process.wait(timeout=10)
