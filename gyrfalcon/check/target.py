"""The server under check: plain HTTP (the standard library's), every reply kept with the request
that produced it, so a failure can be reproduced by hand."""

from __future__ import annotations

import http.client
import json
import shlex
import ssl
import urllib.parse
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from gyrfalcon.check.registry import Broken, Unsupported

#: statuses that refuse a request loudly (a missing route, a refused field or value)
REFUSALS = (400, 404, 405, 415, 422, 501)
#: where the API key is read from when no option gives it (command line and pytest plugin alike)
API_KEY_ENV = "GYRFALCON_CHECK_API_KEY"


@dataclass
class Reply:
    method: str
    path: str
    body: Any
    status: int
    headers: dict[str, str]
    raw: bytes
    curl: str

    @cached_property
    def json(self) -> Any:
        try:
            return json.loads(self.raw)
        except ValueError:
            raise Broken(f"{self.method} {self.path} answered {self.status} with a body that is not JSON: "
                         f"{self.raw[:200]!r}") from None  # fmt: skip

    @cached_property
    def events(self) -> list[Any]:
        """The ``data:`` payloads of a server-sent event stream, JSON decoded (``"[DONE]"`` kept as is)."""
        if not self.headers.get("content-type", "").startswith("text/event-stream"):
            raise Broken(f"{self.path} with stream true answered {self.headers.get('content-type')!r}, "
                         f"not text/event-stream: {self.raw[:200]!r}")  # fmt: skip
        events = []
        for block in self.raw.decode("utf-8", "replace").replace("\r\n", "\n").split("\n\n"):
            data = [line[5:].removeprefix(" ") for line in block.split("\n") if line.startswith("data:")]
            if not data:
                continue
            payload = "\n".join(data)
            if payload == "[DONE]":
                events.append(payload)
                continue
            try:
                events.append(json.loads(payload))
            except ValueError:
                raise Broken(f"a stream event that is not JSON: {payload[:200]!r}") from None
        return events

    def error(self) -> dict[str, Any]:
        """The error object of an error reply (OpenAI's envelope ``{"error": {...}}``)."""
        try:
            body = json.loads(self.raw)
        except ValueError:
            return {"message": self.raw[:200].decode("utf-8", "replace")}
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return body["error"]
        return {"message": str(body)[:200]}

    def describe(self) -> str:
        error = self.error()
        return f"{self.method} {self.path} answered {self.status}: {str(error.get('message', ''))[:160]}"


@dataclass
class Target:
    """``url`` like ``http://127.0.0.1:8000`` (a path prefix is kept); ``model`` defaults to the
    first one ``GET /v1/models`` lists."""

    url: str
    api_key: str | None = None
    model_name: str | None = None
    timeout: float = 120.0
    #: HTTPS without verifying the certificate (a test deployment's self-signed one)
    insecure: bool = False
    #: every reply of the running check, last one last (cleared by the runner between checks)
    replies: list[Reply] = field(default_factory=list)
    #: what checks learned about the server and keep for the next ones (its token ids: see
    #: :mod:`gyrfalcon.check.semantics.ids`)
    learned: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"not an http(s) URL: {self.url!r}")
        self._https = parsed.scheme == "https"
        self._host, self._port = parsed.hostname, parsed.port or (443 if self._https else 80)
        self._prefix = parsed.path.rstrip("/")

    @property
    def model(self) -> str:
        if self.model_name is None:
            reply = self.get("/v1/models")
            data = reply.json.get("data") if reply.status == 200 and isinstance(reply.json, dict) else None
            if not data:
                raise Broken(f"GET /v1/models lists no model ({reply.describe()}); pass --model")
            self.model_name = data[0]["id"]
        return self.model_name

    def _headers(self, body: bool) -> dict[str, str]:
        headers = {"Accept": "application/json, text/event-stream"}
        if body:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _curl(self, method: str, path: str, data: bytes | None) -> str:
        parts = ["curl", "-sS", "-N", *(["-k"] if self.insecure else []), "-X", method, shlex.quote(self.url.rstrip("/") + path)]
        if data is not None:
            parts += ["-H", shlex.quote("Content-Type: application/json")]
        if self.api_key:
            parts += ["-H", '"Authorization: Bearer $API_KEY"']
        if data is not None:
            parts += ["-d", shlex.quote(data.decode())]
        return " ".join(parts)

    def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None, peek: bool = False) -> Reply:
        """``peek``: on a 200, hang up without reading the body (a stream the server should have
        refused; a server that aborts on disconnect then stops generating it)."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        if self._https:
            context = ssl._create_unverified_context() if self.insecure else ssl.create_default_context()
            conn = http.client.HTTPSConnection(self._host, self._port, timeout=self.timeout, context=context)
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
        try:
            conn.request(method, self._prefix + path, body=data, headers=self._headers(data is not None))
            resp = conn.getresponse()
            content = b"" if peek and resp.status == 200 else resp.read()
            reply = Reply(method, path, body, resp.status, {k.lower(): v for k, v in resp.getheaders()}, content,
                          self._curl(method, path, data))  # fmt: skip
        finally:
            conn.close()
        self.replies.append(reply)
        return reply

    def get(self, path: str) -> Reply:
        return self.request("GET", path)

    def post(self, path: str, body: Any, peek: bool = False) -> Reply:
        return self.request("POST", path, body, peek=peek)

    def ok(self, path: str, body: dict[str, Any]) -> Reply:
        """POST ``body`` (``model`` added unless given) and insist on a 200: a refusal means the
        server lacks what the check needs (unsupported); any other status is broken."""
        reply = self.post(path, {"model": self.model, **body})
        return accepted(reply)


def accepted(reply: Reply) -> Reply:
    if reply.status == 200:
        return reply
    if reply.status in REFUSALS:
        raise Unsupported(reply.describe())
    raise Broken(reply.describe())


def refused(reply: Reply, param: str) -> None:
    """A 400 whose error names ``param`` (OpenAI's ``error.param``; a path inside it, such as
    ``messages.0.role``, names it too), or :class:`Broken`."""
    if reply.status == 200:
        raise Broken(f"{reply.path} accepted an invalid {param} (200) instead of a 400 naming it")
    if reply.status in (404, 405):
        raise Unsupported(reply.describe())  # the route itself is missing
    if reply.status != 400:
        raise Broken(f"an invalid {param}: {reply.describe()} (expected 400)")
    named = reply.error().get("param")
    if not isinstance(named, str) or not (named == param or named.startswith((param + ".", param + "["))):
        raise Broken(f"an invalid {param}: a 400 whose error.param is {named!r}, not {param!r} "
                     f"({str(reply.error().get('message', ''))[:120]})")  # fmt: skip
