"""The app's resources, one instance per route (``InferenceResource`` serves each inference
endpoint object of :mod:`gyrfalcon.protocol.endpoints`); responders stay thin and delegate to
protocol (translation) and serving (submit, collect or stream, shape)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote

import falcon
import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from gyrfalcon import __version__
from gyrfalcon.api.connection import connection_of
from gyrfalcon.api.context import ServerContext
from gyrfalcon.api.metrics import MetricsExposition
from gyrfalcon.api.response_store import RENEW_INTERVAL_S
from gyrfalcon.api.sse import start_stream
from gyrfalcon.engine_api.interface import OutputStream
from gyrfalcon.protocol.endpoints import Endpoint
from gyrfalcon.protocol.requests import ServingRequest
from gyrfalcon.serving.responses import conversation_after
from gyrfalcon.errors import Kind, RequestError
from gyrfalcon.logtext import loggable
from gyrfalcon.serving.runner import FORMATTERS, StreamedResponse, complete, stream_chunks, submit_all
from gyrfalcon.engine_api.config import parse_lora_module


access_log = logging.getLogger("gyrfalcon.access")
log = logging.getLogger("gyrfalcon.api")


T = TypeVar("T")


async def offload(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread: CPU work (JSON, tokenizer, template) never holds the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def owner_of_request(req: falcon.Request) -> str:
    """Whose stored responses a request may see: its API key's owner (set by the key check), '' on a
    server without keys."""
    return getattr(req.context, "owner", "")


def json_response(resp: falcon.Response, body: object, status: int = 200) -> None:
    """``body`` as the JSON answer, with ``status``."""
    resp.status = falcon.code_to_http_status(status)
    resp.content_type = falcon.MEDIA_JSON
    resp.data = orjson.dumps(body)


class HealthResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        health = self.ctx.engine.health()
        if not health.ready:
            raise RequestError(health.message or "The model is loading", type=Kind.NOT_READY, retry_after=1)
        json_response(resp, {"status": "ok", **({"decode_path": health.decode_path} if health.decode_path else {}),
                             **({"weight_version": health.weight_version} if health.weight_version else {}),
                             **({"speculative": health.speculative} if health.speculative else {})})  # fmt: skip


class VersionResource:
    async def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        json_response(resp, {"version": __version__})


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
        # a start-up adapter's base_model_name (vLLM's JSON form of --lora-modules) is its parent
        parents = {(name, path): base for name, path, base in map(parse_lora_module, self.ctx.settings.lora_modules or ())}
        for name, path in await offload(self.ctx.engine.lora_adapters):  # vLLM's cards of adapters
            data.append({**data[0], "id": name, "root": path, "parent": parents.get((name, path)) or root,
                         "permission": [{"id": f"modelperm-{name}", **permission}]})  # fmt: skip
        if self.ctx.settings.enable_rl_endpoints:  # a rollout server's weights change: say which serve
            for card in data:
                card["weight_version"] = self.ctx.engine.health().weight_version
        json_response(resp, {"object": "list", "data": data})


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
        owner = owner_of_request(req)
        request_id = req.get_header("X-Request-Id")
        accepting = asyncio.ensure_future(self.ctx.in_body_lane(raw, lambda: self._accept(raw, request_id, owner)))
        try:
            serving, streams = await asyncio.shield(accepting)
        except asyncio.CancelledError:  # the server is stopping this task: what was submitted is aborted
            accepting.add_done_callback(_close_accepted)
            raise
        except BaseException:
            # the future holds this refusal, whose traceback holds this frame, which held the future:
            # a cycle that kept each refused body (10 MB parsed from a 1 MB schema) until a full
            # garbage collection, which untracked dicts never trigger (1.2 GB over 100 of them)
            accepting = None
            raise
        engine = self.ctx.engine
        connection = connection_of(req)
        if connection is not None:
            connection.watch()
        if serving.stream:
            chunks = stream_chunks(engine, serving, streams, connection)
            await chunks.started()  # the status waits for the first output: an error before it is a status
            start_stream(resp, self.streamed(serving, chunks, owner), named=self.endpoint.stored)
        else:
            body = await self.respond(serving, streams, connection, owner)
            resp.content_type = falcon.MEDIA_JSON
            resp.data = await offload(orjson.dumps, body)  # off the event loop, as the body was built
        # ids come from clients: percent-encode whatever a header cannot carry
        resp.set_header("X-Request-Id", quote(serving.response_id, safe="-_.~:/+="))

    async def respond(self, serving: ServingRequest, streams: list[OutputStream], connection: Any,
                      owner: str) -> dict[str, Any]:  # fmt: skip
        """The whole answer of a request that does not stream (``owner``: of what it stores)."""
        return await complete(self.ctx.engine, serving, streams, connection)

    def streamed(self, serving: ServingRequest, chunks: StreamedResponse, owner: str) -> Any:
        """A streamed answer's chunks as they go out."""
        return chunks

    def _history(self, body: Any, owner: str) -> list[dict[str, Any]] | None:
        """The stored turns of ``owner``'s a request continues (none here)."""
        return None

    def _accept(self, raw: bytes, request_id: str | None, owner: str) -> tuple[ServingRequest, list[OutputStream]]:
        """Parse, translate and submit (in a worker thread)."""
        translator = self.ctx.translator()
        body = translator.parse(raw)
        serving = translator.translate(self.endpoint, body, request_id, history=self._history(body, owner))
        access_log.info("%s %s user=%r prompts=%d n=%d stream=%s%s", self.endpoint.name, loggable(serving.response_id),
                        serving.user,
                        len(serving.requests), serving.n, serving.stream,
                        "".join(f" {k}={v!r}" for k, v in serving.recorded.items()))  # fmt: skip
        return serving, [] if serving.prompt_only else submit_all(self.ctx.engine, serving)


def _close_accepted(accepting: asyncio.Future[tuple[ServingRequest, list[OutputStream]]]) -> None:
    if not accepting.cancelled() and accepting.exception() is None:
        for stream in accepting.result()[1]:
            stream.close()


class ResponsesResource(InferenceResource):
    """``POST /v1/responses``: as chat, continuing a stored response and storing its answer."""

    def _history(self, body: Any, owner: str) -> list[dict[str, Any]] | None:
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        if not isinstance(previous, str):
            return None  # (a wrong type is the translator's 400)
        return self.ctx.response_store().conversation(previous, "previous_response_id", owner)

    def _keep(self, serving: ServingRequest, response: dict[str, Any], owner: str) -> None:
        if response.get("store", True):
            self.ctx.response_store().put(response, serving.input_items, conversation_after(serving, response), owner)

    async def respond(self, serving: ServingRequest, streams: list[OutputStream], connection: Any,
                      owner: str) -> dict[str, Any]:  # fmt: skip
        if not serving.response_fields.get("background"):
            body = await complete(self.ctx.engine, serving, streams, connection)
            await offload(self._keep, serving, body, owner)
            return body
        # background: answered at once, in progress; the answer is stored when it ends (the client
        # may leave: its connection is not watched)
        started = FORMATTERS[serving.endpoint](serving, self.ctx.engine).body("in_progress", [], None)
        await offload(self._keep, serving, started, owner)
        task = asyncio.ensure_future(self._background(serving, streams, owner))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)
        return started

    async def _background(self, serving: ServingRequest, streams: list[OutputStream], owner: str) -> None:
        store = self.ctx.response_store()
        watch = asyncio.ensure_future(_stop_when_cancelled(store, serving.response_id, streams))
        try:
            body = await complete(self.ctx.engine, serving, streams, None)
        except RequestError as exc:  # in-band failure, a drain: the response failed
            body = FORMATTERS[serving.endpoint](serving, self.ctx.engine).body("failed", [], None)
            body["error"] = {"code": exc.type, "message": exc.message}
        except Exception as exc:  # noqa: BLE001 - the task has no client to answer: the store says it
            log.exception("background response %s failed", loggable(serving.response_id))
            body = FORMATTERS[serving.endpoint](serving, self.ctx.engine).body("failed", [], None)
            body["error"] = {"code": "server_error", "message": f"Internal error: {type(exc).__name__}"}
        except asyncio.CancelledError:  # the worker stops (finish_background): the store says so, then it goes
            body = FORMATTERS[serving.endpoint](serving, self.ctx.engine).body("failed", [], None)
            body["error"] = {"code": "server_shutting_down", "message": "The server stopped before the response ended"}
            store.put(body, serving.input_items, conversation_after(serving, body), owner, True)
            raise
        finally:
            watch.cancel()
        if body.get("store", True):  # over the stored one only: not over a cancel, a delete, an eviction
            await offload(store.put, body, serving.input_items, conversation_after(serving, body), owner, True)

    def streamed(self, serving: ServingRequest, chunks: StreamedResponse, owner: str) -> Any:
        return _Storing(chunks, lambda response: offload(self._keep, serving, response, owner))


#: background responses running in this worker (kept from the garbage collector)
_BACKGROUND: set[asyncio.Future[None]] = set()


async def finish_background(timeout: float) -> None:
    """A stopping worker's background responses: ``timeout`` seconds to end (a drain cuts what the
    engine still runs, and each stores how it ended), then the rest are cancelled and stored as
    failed: none is left ``in_progress`` in the store by a worker that is gone."""
    running = [task for task in _BACKGROUND if not task.done()]
    if not running:
        return
    _, late = await asyncio.wait(running, timeout=timeout)
    for task in late:
        task.cancel()
    if late:
        await asyncio.wait(late, timeout=5.0)
#: seconds between a background response's looks at the store for a cancel (from any worker)
CANCEL_POLL_S = 0.25


async def _stop_when_cancelled(store: Any, response_id: str, streams: list[OutputStream]) -> None:
    """Close ``streams`` once the store says the response was cancelled; renew its lease meanwhile."""
    renewed = time.monotonic()
    while True:
        await asyncio.sleep(CANCEL_POLL_S)
        if time.monotonic() - renewed >= RENEW_INTERVAL_S:
            renewed = time.monotonic()
            await offload(store.renew, response_id)
        if await offload(store.status, response_id) == "cancelled":
            for stream in streams:
                stream.close()  # aborts the engine's work
            return


class _Storing:
    """A Responses stream's events as they go out; the last one's response is stored first.
    ``close()`` closes the events' source (aborting the engine work), started or not."""

    def __init__(self, chunks: StreamedResponse, keep: Callable[[dict[str, Any]], Any]) -> None:
        self._chunks, self._keep = chunks, keep

    def __aiter__(self) -> _Storing:
        return self

    async def __anext__(self) -> dict[str, Any]:
        chunk = await self._chunks.__anext__()
        if chunk["type"] in ("response.completed", "response.incomplete"):
            await self._keep(chunk["response"])
        return chunk

    async def close(self) -> None:
        await self._chunks.close()


class StoredResponseResource:
    """``GET``/``DELETE /v1/responses/{response_id}``."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_get(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        json_response(resp, await offload(self.ctx.response_store().response, response_id, None, owner_of_request(req)))

    async def on_delete(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        await offload(self.ctx.response_store().delete, response_id, owner_of_request(req))
        json_response(resp, {"id": response_id, "object": "response", "deleted": True})


class ResponseInputItemsResource:
    """``GET /v1/responses/{response_id}/input_items``: a page of the stored input items."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_get(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        items = await offload(self.ctx.response_store().input_items, response_id, owner_of_request(req))
        limit = req.get_param_as_int("limit", min_value=1, max_value=100, default=20)
        order = req.get_param("order", default="desc")
        if order not in ("asc", "desc"):
            raise RequestError("'order' must be asc or desc", "order")
        if order == "desc":
            items = items[::-1]
        after = req.get_param("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise RequestError(f"No input item of this response has the id '{after}'", "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        json_response(resp, {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                     "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})  # fmt: skip


class CancelResponseResource:
    """``POST /v1/responses/{response_id}/cancel``: a background response still running stops (the
    worker running it sees the store say so within :data:`CANCEL_POLL_S`); one that has ended is
    answered as it is; a response that was not in the background cannot be cancelled (a 400)."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_post(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        store = self.ctx.response_store()
        owner = owner_of_request(req)
        if not (await offload(store.response, response_id, None, owner)).get("background"):
            raise RequestError("Only a background response can be cancelled", "response_id")
        json_response(resp, await offload(store.cancel, response_id, owner))


class TokenizeResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        raw, translator = await self.ctx.read_body(req), self.ctx.translator()
        tokens, strings = await self.ctx.in_body_lane(raw, lambda: translator.tokenize(translator.parse(raw)))
        json_response(resp, {"count": len(tokens), "max_model_len": self.ctx.engine.info().max_model_len, "tokens": tokens,
                     "token_strs": strings})  # fmt: skip


class DetokenizeResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        raw, translator = await self.ctx.read_body(req), self.ctx.translator()
        json_response(resp, {"prompt": await self.ctx.in_body_lane(raw, lambda: translator.detokenize(translator.parse(raw)))})


class MetricsResource:
    """Prometheus text exposition: request metrics and the engine's stats (:mod:`gyrfalcon.api.metrics`)."""

    def __init__(self, ctx: ServerContext) -> None:
        # the engine labels its request metrics; an engine without a name takes the served one
        model_name = getattr(ctx.engine, "model_name", None) or ctx.served_model_names[0]
        self.exposition = MetricsExposition(ctx.engine, model_name)
        #: rendered on a thread of its own, never the requests' pool (a render asks the engine)
        self._renderer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gyrfalcon-metrics")
        self._rendered: tuple[float, bytes] | None = None
        self._rendering: asyncio.Future[bytes] | None = None

    async def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = CONTENT_TYPE_LATEST
        resp.data = await self._latest()

    async def _latest(self) -> bytes:
        """The exposition, rendered at most once every METRICS_MAX_AGE_S: scrapes meanwhile (and
        those that come while a render runs) share it, so scraping costs the engine nothing more."""
        rendered = self._rendered
        if rendered is not None and time.monotonic() - rendered[0] < METRICS_MAX_AGE_S:
            return rendered[1]
        loop = asyncio.get_running_loop()
        if self._rendering is None or self._rendering.done() or self._rendering.get_loop() is not loop:
            self._rendering = loop.run_in_executor(self._renderer, self._render)
        return await asyncio.shield(self._rendering)

    def _render(self) -> bytes:
        data = self.exposition.render()
        self._rendered = (time.monotonic(), data)
        return data


#: the oldest a /metrics answer may be (Prometheus scrapes every 15 s or so)
METRICS_MAX_AGE_S = 1.0
