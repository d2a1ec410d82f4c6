"""The app's resources, one instance per route (``InferenceResource`` serves each inference
endpoint object of :mod:`gyrfalcon.protocol.endpoints`); responders stay thin and delegate to
protocol (translation) and serving (submit, collect or stream, shape)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote

import falcon
import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from gyrfalcon import __version__
from gyrfalcon.api.connection import connection_of
from gyrfalcon.api.context import ServerContext
from gyrfalcon.api.errors import APIError
from gyrfalcon.api.metrics import MetricsExposition
from gyrfalcon.api.sse import start_stream
from gyrfalcon.engine_api.interface import OutputStream
from gyrfalcon.protocol.endpoints import Endpoint
from gyrfalcon.protocol.requests import ServingRequest
from gyrfalcon.serving.runner import complete, stream_chunks, submit_all


access_log = logging.getLogger("gyrfalcon.access")


T = TypeVar("T")


async def offload(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread: CPU work (JSON, tokenizer, template) never holds the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _json(resp: falcon.Response, body: object, status: int = 200) -> None:
    resp.status = falcon.code_to_http_status(status)
    resp.content_type = falcon.MEDIA_JSON
    resp.data = orjson.dumps(body)


class HealthResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        health = self.ctx.engine.health()
        if not health.ready:
            raise APIError(503, health.message or "The model is loading", headers={"Retry-After": "1"})
        _json(resp, {"status": "ok", **({"decode_path": health.decode_path} if health.decode_path else {})})


class VersionResource:
    async def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        _json(resp, {"version": __version__})


class ModelsResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        info = self.ctx.ready_info()
        created = self.ctx.started
        root = self.ctx.served_model_names[0]
        permission = {"object": "model_permission", "created": created, "allow_create_engine": False,
                      "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                      "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}  # fmt: skip
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "gyrfalcon", "root": root, "parent": None,
             "max_model_len": info.max_model_len, "permission": [{"id": f"modelperm-{name}", **permission}]}  # fmt: skip
            for name in self.ctx.served_model_names
        ]
        _json(resp, {"object": "list", "data": data})


class OpenAPIResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = falcon.MEDIA_JSON
        resp.data = await offload(self.ctx.served_spec_bytes)


class InferenceResource:
    """POST an inference request: translate, submit, then answer JSON or stream SSE."""

    def __init__(self, ctx: ServerContext, endpoint: Endpoint) -> None:
        self.ctx = ctx
        self.endpoint = endpoint

    async def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        raw = await self.ctx.read_body(req)
        accepting = asyncio.get_running_loop().run_in_executor(None, self._accept, raw, req.get_header("X-Request-Id"))
        try:
            serving, streams = await asyncio.shield(accepting)
        except asyncio.CancelledError:  # the server is stopping this task: what was submitted is aborted
            accepting.add_done_callback(_close_accepted)
            raise
        engine = self.ctx.engine
        connection = connection_of(req)
        if connection is not None:
            connection.watch()
        if serving.stream:
            chunks = stream_chunks(engine, serving, streams, connection)
            await chunks.started()  # the status waits for the first output: an error before it is a status
            start_stream(resp, chunks)
        else:
            _json(resp, await complete(engine, serving, streams, connection))
        # ids come from clients: percent-encode whatever a header cannot carry
        resp.set_header("X-Request-Id", quote(serving.response_id, safe="-_.~:/+="))

    def _accept(self, raw: bytes, request_id: str | None) -> tuple[ServingRequest, list[OutputStream]]:
        """Parse, translate and submit (in a worker thread)."""
        serving = self.ctx.translator().translate(self.endpoint, self.ctx.parse_body(raw), request_id)
        access_log.info("%s %s user=%r prompts=%d n=%d stream=%s%s", self.endpoint.name, serving.response_id, serving.user,
                        len(serving.requests), serving.n, serving.stream,
                        "".join(f" {k}={v!r}" for k, v in serving.recorded.items()))  # fmt: skip
        return serving, [] if serving.prompt_only else submit_all(self.ctx.engine, serving)


def _close_accepted(accepting: asyncio.Future[tuple[ServingRequest, list[OutputStream]]]) -> None:
    if not accepting.cancelled() and accepting.exception() is None:
        for stream in accepting.result()[1]:
            stream.close()


class TokenizeResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        raw = await self.ctx.read_body(req)
        tokens, strings = await offload(lambda: self.ctx.translator().tokenize(self.ctx.parse_body(raw)))
        _json(resp, {"count": len(tokens), "max_model_len": self.ctx.engine.info().max_model_len, "tokens": tokens,
                     "token_strs": strings})  # fmt: skip


class DetokenizeResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        raw = await self.ctx.read_body(req)
        _json(resp, {"prompt": await offload(lambda: self.ctx.translator().detokenize(self.ctx.parse_body(raw)))})


class MetricsResource:
    """Prometheus text exposition: request metrics and the engine's stats (:mod:`gyrfalcon.api.metrics`)."""

    def __init__(self, ctx: ServerContext) -> None:
        # the engine labels its request metrics; an engine without a name takes the served one
        model_name = getattr(ctx.engine, "model_name", None) or ctx.served_model_names[0]
        self.exposition = MetricsExposition(ctx.engine, model_name)

    async def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = CONTENT_TYPE_LATEST
        resp.data = await offload(self.exposition.render)
