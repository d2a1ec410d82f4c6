"""The Falcon ASGI app factory.

``create_app(engine, settings, pm)`` wires the routes around an engine it is given (tests pass the
real engine on a tiny model); what a served process builds it from — settings, plugins, the engine —
is put together in :mod:`gyrfalcon.compose` (gunicorn's worker runs ``gyrfalcon.compose:asgi_app()``).
"""

from __future__ import annotations

import hmac

import falcon
import falcon.asgi
import pluggy

from gyrfalcon.api import errors
from gyrfalcon.api.control import CONTROL_RESOURCES
from gyrfalcon.api.lora import LORA_RESOURCES
from gyrfalcon.api.connection import WatchedApp
from gyrfalcon.api.context import ServerContext
from gyrfalcon.api.response_store import owner_of
from gyrfalcon.api.resources import (
    DetokenizeResource,
    HealthResource,
    InferenceResource,
    MetricsResource,
    ModelsResource,
    OpenAPIResource,
    CancelResponseResource,
    ResponseInputItemsResource,
    ResponsesResource,
    StoredResponseResource,
    TokenizeResource,
    VersionResource,
    finish_background,
)
from gyrfalcon.config import Settings
from gyrfalcon.engine_api.interface import Engine
from gyrfalcon.errors import Kind, RequestError
from gyrfalcon.heap import QuietTrimmer
from gyrfalcon.protocol.endpoints import DETOKENIZE, ENDPOINTS, TOKENIZE

#: routes that answer without an API key
PUBLIC_ROUTES = frozenset({"/health", "/version", "/openapi.json", "/metrics"})


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` on every route but the public ones, when keys are configured."""

    def __init__(self, keys: list[str], preflights: bool = False, public: frozenset[str] = PUBLIC_ROUTES) -> None:
        self.keys = [k.encode() for k in keys]
        #: CORS is on: a browser's preflight (which carries no key) passes
        self.preflights = preflights
        self.public = public

    async def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not self.keys or req.path in self.public:
            return
        if self.preflights and req.method == "OPTIONS" and req.get_header("Access-Control-Request-Method"):
            return
        scheme, _, credentials = (req.get_header("Authorization") or "").strip().partition(" ")
        token = credentials.strip().encode()
        # the scheme is case-insensitive (RFC 9110 §11.1): "bearer" is "Bearer"
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token, k) for k in self.keys):
            raise RequestError("Missing or invalid API key", type=Kind.UNAUTHENTICATED)
        req.context.owner = owner_of(token.decode())  # whose stored responses this request may see


class App(falcon.asgi.App):
    """Falcon's ASGI app whose routes that answer GET answer HEAD too (headers only, as HTTP
    wants), plugin routes included."""

    def add_route(self, uri_template: str, resource: object, **kwargs: object) -> None:
        if hasattr(resource, "on_get") and not hasattr(resource, "on_head"):
            resource.on_head = resource.on_get  # type: ignore[attr-defined]
        super().add_route(uri_template, resource, **kwargs)


class EngineLifespan:
    """Falcon middleware: plugins' start-up and shut-down hooks, and the engine's shutdown, with
    the ASGI server's lifespan; the worker's heap trimmed when it goes quiet after requests
    (:class:`~gyrfalcon.heap.QuietTrimmer`)."""

    def __init__(self, engine: Engine, pm: pluggy.PluginManager, settings: Settings) -> None:
        self.engine, self.pm, self.settings = engine, pm, settings
        self.trimmer: QuietTrimmer | None = None

    async def process_startup(self, scope: dict, event: dict) -> None:
        self.pm.hook.gyrfalcon_startup(settings=self.settings)
        self.trimmer = QuietTrimmer().start()

    async def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if self.trimmer is not None and req.path not in PUBLIC_ROUTES:  # a probe every second is no work
            self.trimmer.worked()

    async def process_shutdown(self, scope: dict, event: dict) -> None:
        self.pm.hook.gyrfalcon_shutdown()
        # the drain has cut what still ran by now; a few seconds more for the background responses
        # to store how they ended
        await finish_background(self.settings.drain_timeout + 5.0)
        self.engine.shutdown(grace=5.0)


def create_app(engine: Engine, settings: Settings, pm: pluggy.PluginManager, *, lifespan: bool = False,
               prepare: bool = False) -> WatchedApp:  # fmt: skip
    """An ASGI app serving ``engine``; plugins may add routes. With ``lifespan`` the ASGI server's
    start-up and shut-down run the plugins' hooks and shut the engine down; with ``prepare`` the
    stored responses are opened now, and the translator and the served spec built if the engine is
    ready (:meth:`ServerContext.prepare`). Build it through :func:`gyrfalcon.compose.app`."""
    ctx = ServerContext(engine, settings, pm)
    if prepare:
        ctx.prepare()
    public = PUBLIC_ROUTES - {"/metrics"} if settings.metrics_require_key else PUBLIC_ROUTES
    middleware: list[object] = [APIKeyMiddleware(settings.api_keys, preflights=bool(settings.allowed_origins), public=public)]
    if settings.allowed_origins:  # before the key check sees it: a browser's preflight carries no key
        origins = "*" if "*" in settings.allowed_origins else settings.allowed_origins
        middleware.insert(0, falcon.CORSMiddleware(allow_origins=origins, expose_headers=["X-Request-Id", "Retry-After"]))
    if lifespan:
        middleware.append(EngineLifespan(engine, pm, settings))
    app = App(middleware=middleware)
    app.req_options.strip_url_path_trailing_slash = True
    errors.install(app)
    app.add_route("/health", HealthResource(ctx))
    app.add_route("/version", VersionResource())
    app.add_route("/metrics", MetricsResource(ctx))
    app.add_route("/openapi.json", OpenAPIResource(ctx))
    app.add_route("/v1/models", ModelsResource(ctx))
    for endpoint in ENDPOINTS.values():
        app.add_route(endpoint.route, (ResponsesResource if endpoint.stored else InferenceResource)(ctx, endpoint))
    app.add_route("/v1/responses/{response_id}", StoredResponseResource(ctx))
    app.add_route("/v1/responses/{response_id}/input_items", ResponseInputItemsResource(ctx))
    app.add_route("/v1/responses/{response_id}/cancel", CancelResponseResource(ctx))
    app.add_route(TOKENIZE.route, TokenizeResource(ctx))
    app.add_route(DETOKENIZE.route, DetokenizeResource(ctx))
    if settings.enable_rl_endpoints:
        for route, resource in CONTROL_RESOURCES.items():
            app.add_route(route, resource(ctx))
    if settings.enable_lora:
        for route, resource in LORA_RESOURCES.items():
            app.add_route(route, resource(ctx))
    pm.hook.gyrfalcon_add_routes(app=app, engine=engine, settings=settings)
    return WatchedApp(app, drain=lambda: engine.drain(settings.drain_timeout))
