"""What ``gyrfalcon serve`` runs: the engine process, then gunicorn's master, stopped in order.

This process imports neither torch nor the app; it starts the engine as a fresh interpreter
(spawned, never forked, in a process group of its own so that a signal to the server's process
group reaches only the API side; in the same session, see :mod:`gyrfalcon.engine_main`), waits
until it listens, then runs gunicorn with the engine's address in the workers' environment.

- SIGTERM (SIGINT, SIGQUIT likewise): the engine drains first (queued requests get a 503 at once),
  gunicorn (sent SIGTERM, its graceful stop) lets its workers finish their streams; once gunicorn
  has exited, the engine stops. gunicorn also stops if this launcher dies.
- Other signals gunicorn understands (HUP, TTIN, TTOU, USR1, USR2) are passed on to it.
- The engine process dying stops the server with exit status 1, for its supervisor (systemd,
  Kubernetes) to restart: the workers have already answered every waiting client with a 503.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from gyrfalcon.engine_process import ENGINE_ADDRESS_ENV

log = logging.getLogger("gyrfalcon.launch")

#: seconds the engine may take to start listening (it listens before loading the model)
LISTEN_TIMEOUT_S = 300.0
#: seconds the engine may take to stop once gunicorn has exited
STOP_TIMEOUT_S = 10.0
_STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
_PASSED_ON = (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGUSR1, signal.SIGUSR2)


def main(argv: list[str]) -> int:
    """``python -m gyrfalcon.engine_process.launch GUNICORN_ARGV...``: what ``gyrfalcon serve`` execs
    into, with the environment it has cleaned (no API key in this process's /proc environ either)."""
    return run_server(argv, dict(os.environ))


def _say(message: str) -> None:
    print(f"gyrfalcon: {message}", file=sys.stderr, flush=True)


def _stop_with_parent() -> None:
    """In gunicorn's master before it runs: SIGTERM when this launcher dies (killed, out of memory),
    so no orphaned server answers 503 for ever (Linux; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _wait_listening(engine: subprocess.Popen, socket_path: str) -> bool:
    deadline = time.monotonic() + LISTEN_TIMEOUT_S
    while time.monotonic() < deadline:
        if os.path.exists(socket_path):
            return True
        if engine.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def _stop(process: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; the exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


#: iterations an OpenMP thread spins at a barrier before it sleeps, in the engine process (libgomp's
#: default: 300,000 when it has a core per thread). Measured on 2 cores, default model, with one
#: other busy process on the machine: spinning threads kept the core the late thread needed, and the
#: engine served 1.9 tok/s at c=1 and 10 at c=16; at 2,000, 45 and 190 (alone, 112 and 378 against
#: 114-127 and 386-396 with the default: within the noise). A server shares its machine with its
#: own API worker at least.
GOMP_SPINCOUNT = "2000"


def engine_env(env: dict[str, str]) -> dict[str, str]:
    """The engine process's environment: ``env``, with :data:`GOMP_SPINCOUNT` unless the operator
    chose how OpenMP threads wait (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` set)."""
    if "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env:
        return env
    return {**env, "GOMP_SPINCOUNT": GOMP_SPINCOUNT}


def run_server(gunicorn_argv: list[str], env: dict[str, str]) -> int:
    """Run the engine process and gunicorn (``gunicorn_argv``) until both have stopped; the exit status."""
    run_dir = tempfile.mkdtemp(prefix="gyrfalcon-run-")  # mode 0700: only this user reaches the engine
    socket_path = os.path.join(run_dir, "engine.sock")
    address = f"ipc://{socket_path}"
    env = {**env, ENGINE_ADDRESS_ENV: address}
    # not a session of its own: under the kernel's autogroup scheduling a session is one CPU group,
    # and the engine's threads shared the cores with an API worker parsing a large body as two
    # equal groups, whatever the worker's nice (api.context.LARGE_BODY_NICE): on 2 cores the
    # median latency of the engine's other requests went 1.8x while a client sent 1 MB schemas
    engine = subprocess.Popen([sys.executable, "-m", "gyrfalcon.engine_main", address], env=engine_env(env),
                              process_group=0)  # fmt: skip
    gunicorn: subprocess.Popen | None = None
    stopping: list[int] = []

    def on_stop(signum: int, frame: object) -> None:
        if not stopping:
            stopping.append(signum)
            if engine.poll() is None:
                engine.send_signal(signal.SIGUSR1)  # its drain: queued requests end at once
        if gunicorn is not None and gunicorn.poll() is None:
            gunicorn.send_signal(signal.SIGTERM)  # gunicorn's graceful stop (its SIGINT and SIGQUIT are quick)

    def pass_on(signum: int, frame: object) -> None:
        if gunicorn is not None and gunicorn.poll() is None:
            gunicorn.send_signal(signum)

    for sig in _STOPPING:
        signal.signal(sig, on_stop)
    for sig in _PASSED_ON:
        signal.signal(sig, pass_on)
    try:
        if not _wait_listening(engine, socket_path):
            _say(f"the engine process did not start (exit status {engine.poll()})")
            return 1
        if stopping:
            return 0
        gunicorn = subprocess.Popen(gunicorn_argv, env=env, preexec_fn=_stop_with_parent)
        engine_died = False
        while gunicorn.poll() is None:
            if not engine_died and engine.poll() is not None:
                engine_died = True
                _say(f"the engine process exited (status {engine.returncode}): stopping the server for its supervisor")
                gunicorn.send_signal(signal.SIGTERM)
            time.sleep(0.1)
        status = gunicorn.returncode
        if engine_died or (engine.poll() is not None and not stopping):
            return 1
        return status
    finally:
        if gunicorn is not None and gunicorn.poll() is None:
            _stop(gunicorn, STOP_TIMEOUT_S)
        _stop(engine, STOP_TIMEOUT_S)
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
