"""The control routes RL trainers drive a rollout server with (``--enable-rl-endpoints``; vLLM's
names and answers, SGLang's for the weights): pause generation around a weight update and resume
it, ask whether it is paused, abort requests by the ids their clients know, serve new weights from
a folder and say which version serves, sleep between rollout phases and wake up. Behind the API key like every route but
the public ones; the served spec lists them only where they are served."""

from __future__ import annotations

import asyncio

import falcon

from gyrfalcon.api.context import ServerContext
from gyrfalcon.api.resources import json_response, offload
from gyrfalcon.engine_api.types import PauseState, SleepState
from gyrfalcon.errors import RequestError
from gyrfalcon.protocol.endpoints import ABORT_REQUESTS, ENDPOINTS, UPDATE_WEIGHTS
from gyrfalcon.protocol.wire import sent_fields, validate

#: how often a pause that has not settled yet is looked at again
SETTLE_POLL_S = 0.01


def _pause_body(state: PauseState) -> dict[str, object]:
    return {"status": "paused" if state.mode is not None else "resumed", "mode": state.mode, "held": state.held}


def no_query(req: falcon.Request) -> None:
    """A 400 for any query parameter (the route takes none: it would be ignored)."""
    _query(req, ())


def _query(req: falcon.Request, allowed: tuple[str, ...]) -> None:
    """A 400 for a query parameter the route does not take (it would be ignored)."""
    for name in req.params:
        if name not in allowed:
            raise RequestError(f"'{name}' is not a parameter of {req.path}", name)


class PauseResource:
    """``POST /pause?mode=…&clear_cache=…``: answered once the pause has taken effect."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        _query(req, ("mode", "clear_cache"))
        mode = req.get_param("mode", default="abort")  # the engine's pause decides whether it is one it knows
        raw = req.get_param("clear_cache", default="true")
        if raw not in ("true", "false"):
            raise RequestError("'clear_cache' must be true or false", "clear_cache")
        state = await offload(self.ctx.engine.pause, mode, raw == "true")
        while state.mode is not None and not state.settled:  # a resume meanwhile ends the wait too
            await asyncio.sleep(SETTLE_POLL_S)
            state = await offload(self.ctx.engine.pause_state)
        json_response(resp, _pause_body(state))


class ResumeResource:
    """``POST /resume``."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        _query(req, ())
        json_response(resp, _pause_body(await offload(self.ctx.engine.resume)))


class IsPausedResource:
    """``GET /is_paused``."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        _query(req, ())
        state = await offload(self.ctx.engine.pause_state)
        json_response(resp, {"is_paused": state.mode is not None, "mode": state.mode, "held": state.held})


class AbortRequestsResource:
    """``POST /inference/v1/abort_requests``: each id as its client gave it, or as its answer
    carries it (the endpoint's prefix around it)."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        _query(req, ())
        body = self.ctx.translator().parse(await self.ctx.read_body(req))
        given = sent_fields(validate(ABORT_REQUESTS, body)).get("request_ids") or []
        groups = sorted({g for i in given for g in (i, *(e.response_id(i) for e in ENDPOINTS.values()))}) or None
        aborted = await offload(self.ctx.engine.abort_requests, groups)
        json_response(resp, {"status": "aborted", "aborted": aborted})


class UpdateWeightsResource:
    """``POST /update_weights_from_disk`` (SGLang's route and answer): answered once the new weights serve."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        _query(req, ())
        body = self.ctx.translator().parse(await self.ctx.read_body(req))
        sent = sent_fields(validate(UPDATE_WEIGHTS, body))
        if sent.get("abort_all_requests"):
            await offload(self.ctx.engine.abort_requests, None)
        flush = sent.get("flush_cache")
        version = await offload(self.ctx.engine.update_weights, sent["model_path"], sent.get("weight_version"),
                                flush is None or flush)  # fmt: skip
        json_response(resp, {"success": True, "message": f"the weights of {sent['model_path']} serve as {version}",
                             "weight_version": version})  # fmt: skip


class WeightVersionResource:
    """``GET /weight_version``."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        _query(req, ())
        json_response(resp, {"weight_version": self.ctx.engine.health().weight_version})


def _sleep_body(state: SleepState) -> dict[str, object]:
    return {"is_sleeping": state.level > 0, "level": state.level, "asleep": list(state.asleep)}


class SleepResource:
    """``POST /sleep?level=…``: answered once the memory is handed back."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        _query(req, ("level",))
        raw = req.get_param("level", default="1")
        if not raw.isdigit():
            raise RequestError(f"'level' must be 1 or 2, got {raw!r}", "level")
        state = await offload(self.ctx.engine.sleep, int(raw))  # the engine's sleep decides which levels it knows
        while state.level and not state.settled:  # a wake meanwhile ends the wait too
            await asyncio.sleep(SETTLE_POLL_S)
            state = await offload(self.ctx.engine.sleep_state)
        json_response(resp, _sleep_body(state))


class WakeUpResource:
    """``POST /wake_up?tags=…``: answered once the parts named serve again."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        _query(req, ("tags",))
        json_response(resp, _sleep_body(await offload(self.ctx.engine.wake_up, req.get_param_as_list("tags"))))


class IsSleepingResource:
    """``GET /is_sleeping``."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        _query(req, ())
        json_response(resp, _sleep_body(await offload(self.ctx.engine.sleep_state)))


#: the resource of each of ``protocol.endpoints.CONTROL_ROUTES``
CONTROL_RESOURCES = {
    "/pause": PauseResource,
    "/resume": ResumeResource,
    "/is_paused": IsPausedResource,
    "/inference/v1/abort_requests": AbortRequestsResource,
    "/update_weights_from_disk": UpdateWeightsResource,
    "/weight_version": WeightVersionResource,
    "/sleep": SleepResource,
    "/wake_up": WakeUpResource,
    "/is_sleeping": IsSleepingResource,
}
