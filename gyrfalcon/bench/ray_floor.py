"""Ray Serve's own floor for gyrfalcon's shape, without gyrfalcon: an ingress deployment (a bare
ASGI app) that calls a second deployment through a handle, unary and streaming.

``python -m gyrfalcon.bench.ray_floor PORT`` serves it on ``PORT`` until SIGTERM; :mod:`.replicas`
times it like the real servers (``POST /v1/completions``: ``stream`` false answers after one
handle call, true streams ``max_tokens`` items, one SSE event each).
"""

from __future__ import annotations

import json
import signal
import sys
import threading


class Items:
    """The second deployment: hands out ``n`` small items."""

    async def one(self) -> bytes:
        return b"x"

    async def many(self, n: int):
        for i in range(n):
            yield b"x" * 8


class Front:
    """The ingress: a bare ASGI app over the handle."""

    def __init__(self, items) -> None:
        self.items = items
        self.streaming = items.options(stream=True)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body or b"{}")
        headers = [(b"content-type", b"text/event-stream" if request.get("stream") else b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if request.get("stream"):
            async for item in self.streaming.many.remote(int(request.get("max_tokens", 1))):
                await send({"type": "http.response.body", "body": b"data: " + item + b"\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        else:
            await send({"type": "http.response.body", "body": await self.items.one.remote()})


def main(port: int) -> int:
    import ray
    from ray import serve

    stop = threading.Event()
    ray.init(include_dashboard=False)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    class Ingress:
        def __init__(self, items) -> None:
            self._items = items

        def __serve_build_asgi_app__(self):
            return Front(self._items)

    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        items = serve.deployment(Items, ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=64).bind()
        ingress = serve.deployment(serve.ingress()(Ingress), ray_actor_options={"num_cpus": 0}).bind(items)
        serve.run(ingress, name="floor", route_prefix="/")
        print("ready", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
