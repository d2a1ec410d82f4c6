"""gunicorn's worker for gyrfalcon: uvicorn serving the ASGI app with :mod:`gyrfalcon.api.protocol`.

An idle, slow or non-reading client costs a socket, not a thread: the open-files soft limit is
raised to the hard limit so that sockets are not what runs out first.
"""

from __future__ import annotations

import functools
import resource
from typing import Any

from uvicorn_worker import UvicornWorker

from gyrfalcon.api.protocol import ConnectionLimits, GuardedHttpProtocol
from gyrfalcon.config import Settings


def raise_open_files_limit() -> int:
    """Raise this process's open-files soft limit to its hard limit; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


class Worker(UvicornWorker):
    """uvicorn with the guarded protocol, the app's lifespan on, and the settings' time limits."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings = Settings.from_env()
        limits = ConnectionLimits(header_timeout=settings.client_header_timeout, send_timeout=settings.send_timeout)
        self.CONFIG_KWARGS = {
            "loop": "auto",
            "http": functools.partial(GuardedHttpProtocol, limits=limits),
            "lifespan": "on",
        }
        super().__init__(*args, **kwargs)

    def init_process(self) -> None:
        raise_open_files_limit()
        super().init_process()
