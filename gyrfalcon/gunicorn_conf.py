"""gunicorn settings for gyrfalcon (``gunicorn -c python:gyrfalcon.gunicorn_conf``).

gthread workers: each concurrent stream holds a thread, so threads cover running + queued requests
plus a few, or overflow waits in the backlog instead of getting a 503. The engine is built per
worker by the app factory, never in the master.
"""

from gyrfalcon.config import Settings

_settings = Settings.from_env()

worker_class = "gthread"
workers = 1
threads = _settings.max_num_seqs + _settings.max_queue_len + 4
timeout = 120  # a worker heartbeat, not a per-request limit
graceful_timeout = 10
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
