"""gunicorn settings for gyrfalcon (``gunicorn -c python:gyrfalcon.gunicorn_conf``).

One uvicorn worker (:class:`gyrfalcon.api.worker.Worker`) serves the ASGI app: every connection is
a socket on its event loop, not a thread. The engine is built in the worker by the app factory,
never in the master.
"""

import math

from gyrfalcon.api.worker import DRAIN_MARGIN_S
from gyrfalcon.config import Settings

worker_class = "gyrfalcon.api.worker.Worker"
workers = 1
timeout = 120  # a worker heartbeat, not a per-request limit
# SIGTERM: the worker drains for --drain-timeout, then ends what is left; the hard kill comes after
graceful_timeout = math.ceil(Settings.from_env().drain_timeout + 2 * DRAIN_MARGIN_S)
keepalive = 5
control_socket_disable = True


def on_exit(server) -> None:  # noqa: ARG001 - gunicorn's hook signature
    """The master is leaving: remove the private API-keys file `gyrfalcon serve` wrote for it."""
    import os

    from gyrfalcon.config import API_KEYS_FILE_ENV

    path = os.environ.get(API_KEYS_FILE_ENV)
    if path and os.path.basename(path).startswith("gyrfalcon-keys-"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
