"""Run a :class:`ServingRequest` on the engine: submit, then collect or stream its outputs in asyncio.

The engine's outputs arrive from its own thread (or process): each stream wakes the request's task
through a :class:`Wakeup`, so no thread waits on a stream and an idle or slow client costs nothing
but its socket. A :class:`Disconnect` (the API's watch of the client's connection) wakes the task
too: a client that went away ends the work, and closing a stream aborts its request in the engine.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from gyrfalcon.engine_api.interface import Engine, OutputStream
from gyrfalcon.engine_api.types import EngineError, RequestOutput
from gyrfalcon.errors import KINDS, Kind, RequestError
from gyrfalcon.protocol.requests import ServingRequest
from gyrfalcon.protocol.endpoints import CHAT, CHAT_BATCH, COMPLETIONS, GENERATE, RESPONSES, Endpoint
from gyrfalcon.serving.formats import ChatFormatter, CompletionFormatter, Formatter, GenerateFormatter
from gyrfalcon.serving.responses import ResponsesFormatter

#: each endpoint's response shapes
FORMATTERS: dict[Endpoint, type[Formatter]] = {
    GENERATE: GenerateFormatter,
    COMPLETIONS: CompletionFormatter,
    CHAT: ChatFormatter,
    CHAT_BATCH: ChatFormatter,
    RESPONSES: ResponsesFormatter,
}

def client_closed() -> RequestError:
    """The error of a request whose client went away (for the log: nobody reads the answer)."""
    return RequestError("The client closed the connection", None, type=Kind.CLIENT_CLOSED)


class Disconnect(Protocol):
    """What the runner knows of the client: whether it went away, and a call when it does."""

    def is_set(self) -> bool: ...

    def add_listener(self, callback: Callable[[], None]) -> None: ...


def submit_all(engine: Engine, serving: ServingRequest) -> list[OutputStream]:
    """Submit every engine request; if one is refused, abort those already accepted and re-raise."""
    streams: list[OutputStream] = []
    try:
        for request in serving.requests:
            streams.append(engine.submit(request))
    except BaseException as exc:
        for stream in streams:
            stream.close()
        if isinstance(exc, RequestError):
            exc.param = serving.wire_param(exc.param)
        raise
    return streams


class Wakeup:
    """Wakes one asyncio task from any thread; many calls before the task runs wake it once."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        self._scheduled = False

    def __call__(self) -> None:
        """From any thread (the engine's step loop)."""
        if self._scheduled:
            return
        self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._set)
        except RuntimeError:  # the loop is closed: its request is over
            pass

    def _set(self) -> None:
        self._scheduled = False
        self._event.set()

    def set(self) -> None:
        """From the loop's own thread."""
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event.clear()


class ClientGone(Exception):
    """The client went away while its request was being read."""


class OutputReader:
    """The outputs of one request's streams, awaited; :meth:`close` aborts what is still running."""

    def __init__(self, serving: ServingRequest, streams: list[OutputStream], gone: Disconnect | None) -> None:
        self.serving = serving
        self.streams = streams
        self.gone = gone
        self.wakeup = Wakeup()
        self._held: dict[int, RequestOutput | None] = {}
        for stream in streams:
            stream.set_waker(self.wakeup)
        if gone is not None:
            gone.add_listener(self.wakeup.set)

    def client_gone(self) -> bool:
        return self.gone is not None and self.gone.is_set()

    def ready(self, i: int) -> RequestOutput | None:
        """Stream ``i``'s next output (None at its end); ``queue.Empty`` when none is ready yet.
        An in-band error is raised as the :class:`RequestError` it carries."""
        if i in self._held:
            return self._held.pop(i)
        output = self.streams[i].get(timeout=0)
        if output is not None and output.error is not None:
            raise self._request_error(output.error)
        return output

    def _request_error(self, error: EngineError) -> RequestError:
        # an engine's failure of a kind of its own stays a failure (a RequestError of such a kind is a refusal)
        kind = error.type if error.type in KINDS else Kind.ENGINE_FAILED
        return RequestError(error.message, self.serving.wire_param(error.param), type=kind, retry_after=error.retry_after)

    async def started(self) -> None:
        """Wait for the first stream's first output (or its end), kept for :meth:`next`: an error
        before it is raised here, while a response's status can still tell it."""
        self._held[0] = await self.next(0)

    async def next(self, i: int) -> RequestOutput | None:
        """Stream ``i``'s next output, None at its end; :class:`ClientGone` when the client left."""
        while True:
            if self.client_gone():
                raise ClientGone
            try:
                return self.ready(i)
            except queue.Empty:
                await self.wakeup.wait()

    async def last_outputs(self) -> list[RequestOutput | None]:
        """Each stream's last output, all streams read as their outputs come (the client side of
        the engine turns token ids into text, and ends choices at stop strings, only as a stream is
        read); None for a stream that ended without one."""
        lasts: list[RequestOutput | None] = [None] * len(self.streams)
        reading = set(range(len(self.streams)))
        while reading:
            if self.client_gone():
                raise ClientGone
            for i in list(reading):
                while True:
                    try:
                        output = self.ready(i)
                    except queue.Empty:
                        break
                    if output is None:
                        reading.discard(i)
                        break
                    lasts[i] = output
            if reading:
                await self.wakeup.wait()
        return lasts

    def close(self) -> None:
        for stream in self.streams:
            stream.set_waker(None)
            stream.close()


async def complete(
    engine: Engine, serving: ServingRequest, streams: list[OutputStream], gone: Disconnect | None = None
) -> dict[str, Any]:
    """Wait for every stream's final output and build the response body; a client that goes away
    ends it with :func:`client_closed` and aborts its sequences in the engine within a step."""
    try:
        formatter = FORMATTERS[serving.endpoint](serving, engine)
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    if serving.prompt_only:
        assert isinstance(formatter, CompletionFormatter)
        return formatter.prompt_only()
    reader = OutputReader(serving, streams, gone)
    try:
        lasts = await reader.last_outputs()
    except ClientGone:
        raise client_closed() from None
    finally:
        reader.close()
    finals: list[RequestOutput] = []
    for last in lasts:
        if last is None or not last.finished:
            raise RequestError("The engine ended the request without a final output", None, type=Kind.ENGINE_FAILED)
        finals.append(last)
    # built on a worker thread: n x logprobs entries can take long, and the event loop also serves
    # every other connection and gunicorn's heartbeat
    return await asyncio.get_running_loop().run_in_executor(None, formatter.final, finals)


class StreamedResponse:
    """The chunks of a streamed response (an async iterator of dicts).

    ``close()`` aborts whatever engine work is still running, even when iteration never started
    (a client that hangs up before the first event), which an async generator's ``finally`` misses.
    """

    def __init__(self, chunks: AsyncIterator[dict[str, Any]], reader: OutputReader | None) -> None:
        self._chunks = chunks
        self._reader = reader

    def __aiter__(self) -> StreamedResponse:
        return self

    async def __anext__(self) -> dict[str, Any]:
        return await self._chunks.__anext__()

    async def started(self) -> None:
        """Wait until the engine has the request's first output, so that an error before it (a
        server shutting down, a failed prefill) is the response's status, not an event after a 200;
        a client that leaves meanwhile is a :func:`client_closed`."""
        if self._reader is None:
            return
        try:
            await self._reader.started()
        except BaseException as exc:
            await self.close()
            if isinstance(exc, ClientGone):
                raise client_closed() from None
            raise

    async def close(self) -> None:
        aclose = getattr(self._chunks, "aclose", None)
        if aclose is not None:
            await aclose()
        if self._reader is not None:
            self._reader.close()


def stream_chunks(
    engine: Engine, serving: ServingRequest, streams: list[OutputStream], gone: Disconnect | None = None
) -> StreamedResponse:
    """The response's SSE chunks; iterating raises :class:`RequestError` for an in-band error.

    Streams are read one after the other (their outputs coalesce meanwhile); every choice's last
    chunk carries its ``finish_reason``. A client that goes away ends the chunks and the work.
    """
    reader = None if serving.prompt_only else OutputReader(serving, streams, gone)
    return StreamedResponse(_chunks(engine, serving, reader), reader)


async def _chunks(engine: Engine, serving: ServingRequest, reader: OutputReader | None) -> AsyncIterator[dict[str, Any]]:
    formatter = FORMATTERS[serving.endpoint](serving, engine)
    each = formatter.with_usage if serving.continuous_usage else (lambda chunk: chunk)
    if reader is None:
        assert isinstance(formatter, CompletionFormatter)
        body = formatter.prompt_only()
        for choice in body["choices"]:  # one choice per chunk
            yield each(formatter.envelope([choice], chunk=True))
        if serving.include_usage:
            yield formatter.usage_chunk(body["usage"]["prompt_tokens"], 0)
        return
    prompt_tokens = completion_tokens = 0
    try:
        for chunk in formatter.opening_chunks():
            yield each(chunk)
        for i in range(len(reader.streams)):
            finished = False
            while (output := await reader.next(i)) is not None:
                formatter.count_generated(i, output)
                for chunk in formatter.delta_chunks(i, output):
                    yield each(chunk)
                if output.finished:
                    finished = True
                    prompt_tokens += len(output.prompt_token_ids)
                    completion_tokens += output.num_generated_tokens
            if not finished:
                raise RequestError("The engine ended the request without a final output", None, type=Kind.ENGINE_FAILED)
        for chunk in formatter.closing_chunks(prompt_tokens, completion_tokens):
            yield each(chunk)
        if serving.include_usage:
            yield formatter.usage_chunk(prompt_tokens, completion_tokens)
    except ClientGone:
        return  # nobody is listening: the finally below aborts the rest
    finally:
        reader.close()
