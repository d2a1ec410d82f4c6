"""The Falcon WSGI app factory.

``create_app(engine, settings, pm)`` wires the routes around an engine it is given (tests pass the
real engine on a tiny model); ``wsgi_app()`` is the gunicorn entry point
(``gunicorn 'gyrfalcon.api.app:wsgi_app()'``) that builds the engine from the settings in the
environment, in the worker process.
"""

from __future__ import annotations

import atexit
import hmac
import logging

import falcon
import pluggy

from gyrfalcon.api import errors
from gyrfalcon.api.context import ServerContext
from gyrfalcon.api.errors import APIError
from gyrfalcon.api.resources import (
    DetokenizeResource,
    HealthResource,
    InferenceResource,
    MetricsResource,
    ModelsResource,
    OpenAPIResource,
    TokenizeResource,
    VersionResource,
)
from gyrfalcon.config import Settings
from gyrfalcon.engine_api.interface import Engine
from gyrfalcon.plugins import merged_dict, plugin_manager

#: routes that answer without an API key
PUBLIC_ROUTES = frozenset({"/health", "/version", "/openapi.json", "/metrics"})


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` on every route but the public ones, when keys are configured."""

    def __init__(self, keys: list[str], preflights: bool = False) -> None:
        self.keys = [k.encode() for k in keys]
        #: CORS is on: a browser's preflight (which carries no key) passes
        self.preflights = preflights

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not self.keys or req.path in PUBLIC_ROUTES:
            return
        if self.preflights and req.method == "OPTIONS" and req.get_header("Access-Control-Request-Method"):
            return
        scheme, _, credentials = (req.get_header("Authorization") or "").strip().partition(" ")
        token = credentials.strip().encode()
        # the scheme is case-insensitive (RFC 9110 §11.1): "bearer" is "Bearer"
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token, k) for k in self.keys):
            raise APIError(401, "Missing or invalid API key", headers={"WWW-Authenticate": "Bearer"})


def _route(app: falcon.App, path: str, resource: object) -> None:
    """Add a route; a resource that answers GET answers HEAD too (headers only, as HTTP wants)."""
    if hasattr(resource, "on_get") and not hasattr(resource, "on_head"):
        resource.on_head = resource.on_get  # type: ignore[attr-defined]
    app.add_route(path, resource)


def create_app(engine: Engine, settings: Settings, pm: pluggy.PluginManager) -> falcon.App:
    """A Falcon app serving ``engine``; plugins may add routes."""
    ctx = ServerContext(engine, settings, pm)
    middleware: list[object] = [APIKeyMiddleware(settings.api_keys, preflights=bool(settings.allowed_origins))]
    if settings.allowed_origins:  # before the key check sees it: a browser's preflight carries no key
        origins = "*" if "*" in settings.allowed_origins else settings.allowed_origins
        middleware.insert(0, falcon.CORSMiddleware(allow_origins=origins, expose_headers=["X-Request-Id", "Retry-After"]))
    app = falcon.App(middleware=middleware)
    app.req_options.strip_url_path_trailing_slash = True
    errors.install(app)
    _route(app, "/health", HealthResource(ctx))
    _route(app, "/version", VersionResource())
    _route(app, "/metrics", MetricsResource(ctx))
    _route(app, "/openapi.json", OpenAPIResource(ctx))
    _route(app, "/v1/models", ModelsResource(ctx))
    _route(app, "/inference/v1/generate", InferenceResource(ctx, "generate"))
    _route(app, "/v1/completions", InferenceResource(ctx, "completions"))
    _route(app, "/v1/chat/completions", InferenceResource(ctx, "chat"))
    _route(app, "/v1/chat/completions/batch", InferenceResource(ctx, "chat_batch"))
    _route(app, "/tokenize", TokenizeResource(ctx))
    _route(app, "/detokenize", DetokenizeResource(ctx))
    pm.hook.gyrfalcon_add_routes(app=app, engine=engine, settings=settings)
    return app


def build_engine(settings: Settings, pm: pluggy.PluginManager) -> Engine:
    """The engine backend named by ``settings.engine``, from the plugins' offers."""
    engines = merged_dict(pm.hook.gyrfalcon_engines(), "engine")
    if settings.engine not in engines:
        raise SystemExit(f"--engine {settings.engine!r} is not installed; available: {', '.join(sorted(engines))}")
    return engines[settings.engine](settings, pm)


def wsgi_app() -> falcon.App:
    """gunicorn entry point: settings from the environment, engine built in this worker."""
    settings = Settings.from_env()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] [%(process)d] [%(levelname)s] %(name)s: %(message)s")
    pm = plugin_manager(settings.plugins_allow, settings.plugins_block)
    engine = build_engine(settings, pm)
    app = create_app(engine, settings, pm)
    pm.hook.gyrfalcon_startup(settings=settings)

    def _stop() -> None:
        pm.hook.gyrfalcon_shutdown()
        engine.shutdown(grace=5.0)

    atexit.register(_stop)
    return app
