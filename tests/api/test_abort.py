"""A client that disconnects mid-stream: the ASGI server reports it, the engine
frees the request's sequences within a few steps, and a concurrent request is unaffected."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from gyrfalcon.config import Settings
from tests.helpers import api_client, served_app


def http_scope(path: str, body: bytes) -> dict:
    """The ASGI scope of a JSON POST, as uvicorn builds it."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}  # fmt: skip


def test_stream_disconnect_frees_the_sequences(slow_engine, tiny_model_dir):
    engine = slow_engine
    app = served_app(engine, Settings(model=tiny_model_dir, served_model_name=["tiny"]))
    client = api_client(app)
    body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 150, "temperature": 1.0, "n": 3,
                       "ignore_eos": True, "stream": True}).encode()  # fmt: skip
    other: dict = {}
    counts: dict = {}

    async def leave_mid_stream() -> list[dict]:
        sent: list[dict] = []
        first_event, leave = asyncio.Event(), asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            await leave.wait()  # the server reports the client's disconnect
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message.get("body", b"").startswith(b"data: "):
                first_event.set()

        task = asyncio.create_task(app(http_scope("/v1/completions", body), receive, send))
        await asyncio.wait_for(first_event.wait(), 20)
        worker = threading.Thread(target=lambda: other.update(client.simulate_post(
            "/v1/completions", json={"prompt": "Hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True}).json))
        worker.start()
        deadline = time.monotonic() + 20
        while engine.stats()["running_sequences"] < 4:
            assert time.monotonic() < deadline, engine.stats()
            await asyncio.sleep(0.002)
        counts["aborted"], counts["steps"] = engine.stats()["requests_aborted"], engine.stats()["decode_forwards"]
        leave.set()
        await asyncio.wait_for(task, 20)  # the response ends without waiting for its 150 tokens
        while engine.stats()["requests_aborted"] == counts["aborted"]:  # the engine drops it at its next step
            assert time.monotonic() < deadline
            await asyncio.sleep(0.002)
        counts["steps_after"] = engine.stats()["decode_forwards"]
        counts["running_after"] = engine.stats()["running_sequences"]
        counts["aborted_after"] = engine.stats()["requests_aborted"]
        await asyncio.get_running_loop().run_in_executor(None, worker.join, 20)
        return sent

    sent = asyncio.run(leave_mid_stream())
    assert sent[0]["status"] == 200
    assert counts["aborted_after"] == counts["aborted"] + 1
    assert counts["steps_after"] - counts["steps"] <= 3
    assert counts["running_after"] <= 1  # only the other request is left
    choice = other["choices"][0]
    assert choice["finish_reason"] == "length" and other["usage"]["completion_tokens"] == 40
    alone = client.simulate_post("/v1/completions", json={"prompt": "Hello", "max_tokens": 40, "temperature": 0,
                                                         "ignore_eos": True}).json  # fmt: skip
    assert alone["choices"][0]["text"] == choice["text"]
