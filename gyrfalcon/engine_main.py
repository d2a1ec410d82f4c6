"""The engine process's entry point: ``python -m gyrfalcon.engine_main ADDRESS`` (started by
``gyrfalcon serve``'s launcher, :mod:`gyrfalcon.engine_process.launch`). It sits beside ``cli.py``
because, like it, it composes the whole (settings, plugins, engine: :mod:`gyrfalcon.compose`) and
hands it to a room below (:class:`~gyrfalcon.engine_process.server.EngineServer`).

Settings come from the environment (as for the API workers). The process leads a process group of
its own, so a signal to the server's process group (Ctrl-C in a terminal) never reaches it: its
launcher signals it. It stays in the launcher's session, so that the kernel's autogroup scheduling
weighs its threads against the API workers' one by one (``nice`` included) rather than as two
equal groups; as a background group of that session it ignores SIGTTOU (a terminal set to
``tostop`` would otherwise stop it at its first log line). SIGUSR1 drains the engine (health 503,
queued requests end with a 503, running ones have ``--drain-timeout``) while the workers finish
their streams; SIGTERM, or the launcher's death, stops it. An engine whose model cannot load exits with status 1 (its launcher then stops
the server, so that a supervisor sees the failure).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    if len(argv) != 1:
        print("usage: python -m gyrfalcon.engine_main ADDRESS", file=sys.stderr)
        return 2
    from gyrfalcon.compose import engine_core
    from gyrfalcon.config import Settings
    from gyrfalcon.engine_process.server import EngineServer

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] [%(process)d] [%(levelname)s] engine: %(message)s")
    settings = Settings.from_env()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # signals that come while the engine is built: a drain is kept for the server, a stop ends the start
    early: list[int] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: early.append(signum))
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    core = engine_core(settings)
    server = EngineServer(core, argv[0], parent_pid=os.getppid())
    signal.signal(signal.SIGUSR1, lambda signum, frame: server.drain(settings.drain_timeout))
    signal.signal(signal.SIGTERM, lambda signum, frame: server.stop())
    if early:
        server.drain(settings.drain_timeout)
    failed = _stop_if_the_model_fails(core, server)
    logging.getLogger(__name__).info("serving the engine at %s", argv[0])
    try:
        server.serve()
    finally:
        core.shutdown(grace=0.0)
    if failed:  # non-zero: the supervisor (gyrfalcon serve's launcher, systemd, k8s) sees it
        logging.getLogger(__name__).error("exiting: %s", failed[0])
        return 1
    return 0


def _stop_if_the_model_fails(core, server) -> list[str]:
    """Watch the model load (in the core's own thread); if it fails, stop serving. Returns the list
    the failure's message is put in."""
    failed: list[str] = []

    def watch() -> None:
        health = core.health()
        while not health.ready and not health.message.startswith("model failed"):
            time.sleep(0.2)
            health = core.health()
        if not health.ready:
            failed.append(health.message)
            server.stop()

    threading.Thread(target=watch, name="gyrfalcon-load-watch", daemon=True).start()
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
