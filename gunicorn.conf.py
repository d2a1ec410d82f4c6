"""gunicorn reads ./gunicorn.conf.py by itself: running gunicorn from the project root gets the same
settings as `gyrfalcon serve` (gthread workers, threads sized for running + queued requests)."""

from gyrfalcon.gunicorn_conf import *  # noqa: F401,F403
