"""Small helpers shared by the API, live and client tests."""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict
from typing import Any

import falcon.testing


def served_app(engine: Any, settings: Any, pm: Any = None) -> Any:
    """The app over ``engine`` as a server's workers build it, through the composition root
    (``compose.app``: the settings' plugins unless ``pm`` is given, the translator and served spec
    built at once), without the ASGI lifespan: the test owns the engine."""
    from gyrfalcon import compose

    return compose.app(settings, engine, pm, lifespan=False)


class WaitingClient:
    """ASGI middleware for in-process tests: the client waits for its whole answer.

    Falcon's simulated client sends ``http.disconnect`` as soon as its body is read, as if it hung
    up at once; the app notices disconnects and would end the request. A real client keeps its
    connection open until the answer is in: here the disconnect waits for the response's last body.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        answered = asyncio.Event()

        async def patient_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.disconnect" and scope["type"] == "http":
                await answered.wait()
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                answered.set()

        await self.app(scope, patient_receive, tracking_send)


def api_client(app: Any) -> falcon.testing.TestClient:
    """A Falcon test client for ``app`` whose requests wait for their answer (see :class:`WaitingClient`)."""
    return falcon.testing.TestClient(WaitingClient(app))


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded; the final ``[DONE]`` stays a string."""
    events = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def stream_by_choice(events: list[Any], text_of=lambda c: c.get("text", "")) -> dict[int, dict[str, Any]]:
    """Join streamed deltas per choice index; record every finish chunk seen for each choice."""
    assert events and events[-1] == "[DONE]", "a stream must end with [DONE]"
    joined: dict[int, dict[str, Any]] = defaultdict(lambda: {"text": "", "token_ids": [], "finishes": [], "after_finish": 0})
    for event in events[:-1]:
        assert "error" not in event, event
        # one choice per chunk, as OpenAI and vLLM send them (the usage chunk has none)
        assert len(event["choices"]) <= 1, event
        for choice in event["choices"]:
            slot = joined[choice["index"]]
            if slot["finishes"]:
                slot["after_finish"] += 1
            slot["text"] += text_of(choice) or ""
            slot["token_ids"] += choice.get("token_ids") or []
            if choice.get("finish_reason") is not None:
                slot["finishes"].append(choice["finish_reason"])
    return dict(joined)


def chat_delta_text(choice: dict[str, Any]) -> str:
    return choice.get("delta", {}).get("content") or ""


def ok(r) -> dict[str, Any]:
    """A ``requests`` response that must be a 200: its JSON."""
    assert r.status_code == 200, r.text
    return r.json()


def refused(r, param: str) -> dict[str, Any]:
    """A ``requests`` response that must be a 400 in the error envelope naming ``param``: its error."""
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["message"], error
    return error


class ServedInThread:
    """An ASGI app on a local port: uvicorn with gyrfalcon's guarded protocol, in a thread, for
    clients that speak HTTP (``with ServedInThread(app, limits) as url: ...``)."""

    def __init__(self, app: Any, limits: Any = None, protocol_class: Any = None) -> None:
        import functools

        import uvicorn

        from gyrfalcon.api.protocol import ConnectionLimits, GuardedHttpProtocol

        protocol = functools.partial(protocol_class or GuardedHttpProtocol, limits=limits or ConnectionLimits())
        config = uvicorn.Config(app, host="127.0.0.1", port=0, http=protocol, lifespan="off", log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = None

    def __enter__(self) -> str:
        import threading
        import time

        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of the shapes clients send: objects of scalars, enums, bounded strings and
    numbers, arrays, nested objects, optional properties."""

    def value(depth: int) -> dict:
        kinds = ["string", "integer", "number", "boolean", "enum", "null"] + (["object", "array"] if depth < 2 else [])
        kind = rng.choice(kinds)
        if kind == "enum":
            return {"enum": rng.sample(["x", "y", "z", 1, 2, True, None], 3)}
        if kind == "object":
            return random_schema(rng, depth + 1)
        if kind == "array":
            return {"type": "array", "items": value(depth + 1), "minItems": rng.randint(0, 1), "maxItems": 3}
        if kind == "string":
            return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
        if kind == "integer":
            return {"type": "integer", "minimum": -5, "maximum": rng.choice([9, 500])}
        if kind == "number":
            return {"type": "number", "minimum": 0, "maximum": 10}
        return {"type": kind}

    props = {f"k{i}": value(depth) for i in range(rng.randint(1, 4))}
    required = [name for name in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
