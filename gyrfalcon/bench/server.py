"""``gyrfalcon serve`` started for a benchmark run: on a free port, logging to a file, stopped at the end."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from gyrfalcon.bench.client import Client


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_option(argv: list[str], name: str) -> bool:
    """Whether ``argv`` sets the long option ``name`` (``--name V`` or ``--name=V``)."""
    return any(arg == name or arg.startswith(name + "=") for arg in argv)


def serve_argv(port: int, model: str | None, device: str, dtype: str, threads: int, max_concurrency: int,
               extra: str = "") -> list[str]:  # fmt: skip
    """The ``gyrfalcon serve`` command line: the run's device, dtype and threads, room for every level, then ``extra``.

    ``--max-num-seqs`` defaults to the largest concurrency (every request of a level in one batch)
    and ``--max-queue-len`` to twice that, unless ``extra`` (split like a shell would) sets them;
    ``extra`` comes last, so its other options win over the run's too.
    """
    tail = shlex.split(extra)
    argv = [sys.executable, "-m", "gyrfalcon.cli", "serve", "--port", str(port), "--device", device, "--dtype", dtype,
            "--num-threads", str(threads)]  # fmt: skip
    if model:
        argv += ["--model", model]
    if not has_option(tail, "--max-num-seqs"):
        argv += ["--max-num-seqs", str(max_concurrency)]
    if not has_option(tail, "--max-queue-len"):
        argv += ["--max-queue-len", str(max(64, 2 * max_concurrency))]
    return argv + tail


@dataclass
class Server:
    """A launched server: its process, URL, log file and command line."""

    proc: subprocess.Popen
    url: str
    log: str
    argv: list[str]

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """Terminate the server (gunicorn stops its workers), killing it after 30 s."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _settled(body: bytes) -> bool:
    """Whether a 200 ``/health`` body says the decode path is settled (no compile still running)."""
    from gyrfalcon.engine.model.captured import COMPILING

    try:
        return COMPILING not in json.loads(body).get("decode_path", "")
    except ValueError:
        return True


#: how long a launched server may take to be healthy and settled: the first start on a machine
#: compiles the CPU's five decode buckets in the background, about 6 minutes on 2 cores for the
#: default model (inductor's cache then makes later starts take seconds)
LAUNCH_TIMEOUT_S = 900.0


def launch(argv_for_port, log: str, timeout_s: float = LAUNCH_TIMEOUT_S) -> Server:
    """Start ``argv_for_port(port)`` on a free port, its output into ``log``; return it once ``/health``
    answers 200 and its decode path is settled (a compile in the background has ended: what is
    measured is the path that serves).

    Raises RuntimeError with the end of the log if the server exits or is not healthy in time.
    """
    port = _free_port()
    argv = argv_for_port(port)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log, argv)
    client = Client(server.url, timeout=5)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; the end of its log:\n{server.log_tail()}")
        try:
            status, body = client.get("/health")
            if status == 200 and _settled(body):
                return server
        except OSError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"the server did not become healthy in {timeout_s:.0f} s; the end of its log:\n{server.log_tail()}")
