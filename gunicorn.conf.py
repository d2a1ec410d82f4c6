"""gunicorn reads ./gunicorn.conf.py by itself: running gunicorn from the project root gets the same
settings as `gyrfalcon serve` (one uvicorn worker serving the ASGI app: `gyrfalcon.compose:asgi_app()`)."""

from gyrfalcon.gunicorn_conf import *  # noqa: F401,F403
