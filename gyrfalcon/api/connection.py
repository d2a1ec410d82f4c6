"""The client's connection as the ASGI server reports it, watched for a disconnect.

Falcon reads a request's body through ``receive``; once a responder has its body it calls
:meth:`Connection.watch`, and from then on a task waits on ``receive`` for ``http.disconnect``
(which the server sends when the socket is really gone: :mod:`gyrfalcon.api.protocol` keeps a
half-closed socket open). The serving runner listens, so a client that leaves ends its work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import falcon

#: the scope key under which :class:`WatchedApp` puts a request's :class:`Connection`
SCOPE_KEY = "gyrfalcon.connection"

Receive = Callable[[], Awaitable[dict[str, Any]]]


class Connection:
    """One request's client: its ``receive`` channel and whether it went away."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._gone = False
        self._listeners: list[Callable[[], None]] = []
        self._watcher: asyncio.Task[None] | None = None

    async def receive(self) -> dict[str, Any]:
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self._disconnected()
        return message

    def watch(self) -> None:
        """Start noticing a disconnect; call once the request's body has been read."""
        if self._watcher is None and not self._gone:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass  # the rest of a body nobody reads
        self._disconnected()

    def _disconnected(self) -> None:
        if self._gone:
            return
        self._gone = True
        for callback in self._listeners:
            callback()

    def is_set(self) -> bool:
        """The client went away."""
        return self._gone

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (in the event loop) when the client goes away (now, if it has)."""
        self._listeners.append(callback)
        if self._gone:
            callback()

    def close(self) -> None:
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()


def connection_of(req: falcon.Request) -> Connection | None:
    """The request's :class:`Connection` (None outside :class:`WatchedApp`)."""
    return req.scope.get(SCOPE_KEY)  # type: ignore[attr-defined]


class WatchedApp:
    """The served ASGI app: the Falcon app, each HTTP request given a :class:`Connection`.

    ``drain`` (called when the server is told to stop) stops admitting requests and gives the
    running ones their last seconds (see ``EngineCore.drain``).
    """

    def __init__(self, app: falcon.asgi.App, drain: Callable[[], None] = lambda: None) -> None:
        #: the Falcon app (routes, middleware, error handlers)
        self.falcon = app
        self.drain = drain

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Callable[..., Awaitable[None]]) -> None:
        if scope["type"] != "http":  # lifespan
            await self.falcon(scope, receive, send)
            return
        connection = Connection(receive)
        scope[SCOPE_KEY] = connection
        try:
            await self.falcon(scope, connection.receive, send)
        finally:
            connection.close()
