"""gunicorn's worker for gyrfalcon: uvicorn serving the ASGI app with :mod:`gyrfalcon.api.protocol`.

An idle, slow or non-reading client costs a socket, not a thread: the open-files soft limit is
raised to the hard limit so that sockets are not what runs out first.

SIGTERM (gunicorn's graceful stop) drains: the app stops admitting at once (queued requests get a
503 with ``Retry-After``, new ones too), uvicorn stops listening and waits for the running requests,
which have ``--drain-timeout`` seconds before the engine ends them with a 503 error event; gunicorn's
own hard kill comes later (``graceful_timeout`` in :mod:`gyrfalcon.gunicorn_conf`).
"""

from __future__ import annotations

import resource
import sys
import threading
from types import FrameType
from typing import Any

from gunicorn.arbiter import Arbiter
from uvicorn import Config, Server
from uvicorn_worker import UvicornWorker

from gyrfalcon.config import Settings


def raise_open_files_limit() -> int:
    """Raise this process's open-files soft limit to its hard limit; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


#: seconds uvicorn waits, after the drain's own time, for responses to end before cancelling them
DRAIN_MARGIN_S = 3.0


class DrainingServer(Server):
    """uvicorn's server that drains the app (``app.drain()``) at the first exit signal."""

    def __init__(self, config: Config, drain: Any) -> None:
        super().__init__(config)
        self._drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self._drain is not None:
            # never inside the signal handler: it interrupts the loop thread, which may hold the
            # engine's lock (an abort, a stop string) that the drain takes
            threading.Thread(target=self._drain, name="gyrfalcon-drain", daemon=True).start()
        super().handle_exit(sig, frame)


def guarded_protocol(header_timeout: float, send_timeout: float) -> Any:
    """uvicorn's ``http`` protocol factory: :class:`~gyrfalcon.api.protocol.GuardedHttpProtocol`
    with these limits, imported at the first connection. gunicorn's master builds each worker
    object before it forks, so what this module imports the master holds too (falcon's 5 MiB)."""

    def protocol(*args: Any, **kwargs: Any) -> Any:
        from gyrfalcon.api.protocol import ConnectionLimits, GuardedHttpProtocol

        limits = ConnectionLimits(header_timeout=header_timeout, send_timeout=send_timeout)
        return GuardedHttpProtocol(*args, limits=limits, **kwargs)

    return protocol


#: how long a thread holding the GIL (a large body's parsing) may keep it from the event loop that
#: wants it; CPython's default, 5 ms, is paid again at each of a request's many turns of the loop
SWITCH_INTERVAL_S = 0.0005


class Worker(UvicornWorker):
    """uvicorn with the guarded protocol, the app's lifespan on, and the settings' time limits."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings = Settings.from_env()
        self.CONFIG_KWARGS = {
            "loop": "auto",
            "http": guarded_protocol(settings.client_header_timeout, settings.send_timeout),
            "lifespan": "on",
            "timeout_graceful_shutdown": settings.drain_timeout + DRAIN_MARGIN_S,
        }
        super().__init__(*args, **kwargs)

    def init_process(self) -> None:
        raise_open_files_limit()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        super().init_process()

    async def _serve(self) -> None:
        # UvicornWorker's, with a server that drains the app before it stops
        self.config.app = self.wsgi
        server = DrainingServer(self.config, getattr(self.wsgi, "drain", None))
        self._install_sigquit_handler()
        await server.serve(sockets=self.sockets)
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)
