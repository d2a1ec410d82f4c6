"""The composition root: settings → plugins → engine (a core, or a client over one) → app.

Every process that serves is put together here, and nowhere else:

- ``gyrfalcon serve`` and ``serve run gyrfalcon.ray:app``: :func:`serve_settings` turns the options
  (derived from :class:`gyrfalcon.config.Settings`, :func:`add_serve_arguments`) into checked settings;
- a gunicorn worker: :func:`asgi_app`, the app over :func:`worker_engine`;
- the engine process and a Ray engine replica: :func:`engine_core`;
- a Ray ingress replica: :func:`app` over the engine it is handed.

Nothing here imports torch or the app at module level: the command line's process stays light.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from typing import TYPE_CHECKING, Any

from gyrfalcon import config
from gyrfalcon.config import Settings

if TYPE_CHECKING:  # pragma: no cover
    import pluggy

    from gyrfalcon.engine_api.interface import Engine

#: prometheus-client's multiprocess directory: every API worker writes its request metrics there
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: prefix of the directory ``gyrfalcon serve`` makes when the user names none (removed at exit)
METRICS_DIR_PREFIX = "gyrfalcon-metrics-"
#: the log line of the server's processes
LOG_FORMAT = "[%(asctime)s] [%(process)d] [%(levelname)s] %(name)s: %(message)s"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """``gyrfalcon serve``'s options: one per setting, and where to listen."""
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on")
    config.add_arguments(parser)
    parser.add_argument("--api-key-file", default=None, help="a file of API keys, one per line (blank lines and # "
                        "comments ignored); the workers read the keys from a private copy, never from their "
                        "environment")  # fmt: skip


def serve_settings(args: argparse.Namespace) -> Settings:
    """The settings of parsed ``serve`` options, with the keys of the environment and the key
    file, checked (ValueError or OSError: one line for the user), and the served names fixed
    before the model path is resolved to a cache folder."""
    settings = config.from_args(args)
    settings.api_keys = [*settings.api_keys, *config.api_keys_from_env_and_file(args.api_key_file)]
    settings.validate()
    settings.served_model_name = settings.served_names()  # named after what the user gave, not the cache
    return settings


def plugins(settings: Settings) -> pluggy.PluginManager:
    """The plugin manager of ``settings`` (``--plugins-allow`` / ``--plugins-block``)."""
    from gyrfalcon.plugins import settings_plugin_manager

    return settings_plugin_manager(settings)


def check_plugins(settings: Settings, pm: pluggy.PluginManager) -> None:
    """Raise ValueError unless the engine and tool-call parser the settings name are installed."""
    from gyrfalcon.plugins import installed

    installed(pm.hook.gyrfalcon_engines(), "engine", settings.engine)
    installed(pm.hook.gyrfalcon_tool_parsers(), "tool-call parser", settings.tool_call_parser)


def engine_core(settings: Settings, pm: pluggy.PluginManager | None = None) -> Any:
    """The token-id core of the engine the settings name: what the engine process and a Ray
    replica serve (the text work runs in the API workers)."""
    from gyrfalcon.plugins.engines import engine_core as core_of

    return core_of(_built_engine(settings, pm or plugins(settings)))


def _built_engine(settings: Settings, pm: pluggy.PluginManager) -> Engine:
    """The engine the settings name, built in this process."""
    from gyrfalcon.plugins.engines import build_engine

    return build_engine(settings, pm)


def worker_engine(settings: Settings, pm: pluggy.PluginManager) -> Engine:
    """The engine of an API worker: the engine process's core (when ``gyrfalcon serve`` started one,
    :data:`~gyrfalcon.engine_process.ENGINE_ADDRESS_ENV`) behind this worker's text work, else an
    engine built in this worker."""
    from gyrfalcon.engine_process import ENGINE_ADDRESS_ENV

    address = os.environ.get(ENGINE_ADDRESS_ENV)
    if not address:
        return _built_engine(settings, pm)
    from gyrfalcon.client import EngineClient
    from gyrfalcon.engine_process.remote import RemoteEngineCore

    client = EngineClient(RemoteEngineCore(address), model_name=settings.served_names()[0])
    client.tokenizer  # noqa: B018 - loaded now, not on the first request
    return client


def app(settings: Settings, engine: Engine, pm: pluggy.PluginManager | None = None, *, lifespan: bool = True) -> Any:
    """The served ASGI app over ``engine``, its stored responses opened now and its translator and
    served spec built now when the engine is ready; with ``lifespan`` (a server's) the plugins' start-up and shut-down hooks run and the
    engine is shut down with the app. Tests build their apps here too, without the lifespan."""
    from gyrfalcon.api.app import create_app

    return create_app(engine, settings, pm or plugins(settings), lifespan=lifespan, prepare=True)


def asgi_app() -> Any:
    """A gunicorn worker's entry point: settings from the environment, the engine from
    :func:`worker_engine`."""
    settings = Settings.from_env()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    pm = plugins(settings)
    return app(settings, worker_engine(settings, pm), pm)


def metrics_dir(env: dict[str, str]) -> str:
    """The multiprocess metrics directory for a new server: the user's (``$PROMETHEUS_MULTIPROC_DIR``),
    cleared of an earlier server's files, or a new private one."""
    path = env.get(METRICS_DIR_ENV)
    if not path:
        return tempfile.mkdtemp(prefix=METRICS_DIR_PREFIX)
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if name.endswith(".db"):  # counts of a server that is gone would be added to ours
            os.unlink(os.path.join(path, name))
    return path
