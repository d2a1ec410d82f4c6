"""gunicorn settings for gyrfalcon (``gunicorn -c python:gyrfalcon.gunicorn_conf``).

uvicorn workers (:class:`gyrfalcon.api.worker.Worker`; ``gyrfalcon serve --api-workers N``) serve
the ASGI app: every connection is a socket on a worker's event loop, not a thread. Each worker
reaches the engine process that ``gyrfalcon serve`` started (:mod:`gyrfalcon.engine_process`), or,
without one, builds the engine itself; the master never imports torch.
"""

import math
import os
import shutil

from gyrfalcon.api.worker import DRAIN_MARGIN_S
from gyrfalcon.config import Settings

worker_class = "gyrfalcon.api.worker.Worker"
workers = 1
timeout = 120  # a worker heartbeat, not a per-request limit
# SIGTERM: the worker drains for --drain-timeout, then ends what is left; the hard kill comes after
graceful_timeout = math.ceil(Settings.from_env().drain_timeout + 2 * DRAIN_MARGIN_S)
keepalive = 5
control_socket_disable = True


def post_worker_init(worker) -> None:  # noqa: ARG001 - gunicorn's hook signature
    """The worker has built its app: what it holds now lives as long as it, out of the garbage
    collector's full passes (:func:`gyrfalcon.heap.freeze_long_lived`)."""
    from gyrfalcon.heap import freeze_long_lived

    freeze_long_lived()


def child_exit(server, worker) -> None:  # noqa: ARG001 - gunicorn's hook signature
    """A worker is gone: prometheus-client drops its live gauges (its counts stay summed)."""
    from gyrfalcon.compose import METRICS_DIR_ENV

    if os.environ.get(METRICS_DIR_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)


def on_exit(server) -> None:  # noqa: ARG001 - gunicorn's hook signature
    """The master is leaving: remove the private API-keys file and the metrics directory that
    `gyrfalcon serve` made for it (never a directory the user named)."""
    from gyrfalcon.compose import METRICS_DIR_ENV, METRICS_DIR_PREFIX
    from gyrfalcon.config import API_KEYS_FILE_ENV, PRIVATE_KEYS_PREFIX

    path = os.environ.get(API_KEYS_FILE_ENV)
    if path and os.path.basename(path).startswith(PRIVATE_KEYS_PREFIX):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    metrics = os.environ.get(METRICS_DIR_ENV)
    if metrics and os.path.basename(os.path.normpath(metrics)).startswith(METRICS_DIR_PREFIX):
        shutil.rmtree(metrics, ignore_errors=True)
