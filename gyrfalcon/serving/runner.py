"""Run a :class:`ServingRequest` on the engine: submit synchronously, then collect or stream."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

from gyrfalcon.engine_api.interface import Engine, OutputStream
from gyrfalcon.engine_api.streams import follow
from gyrfalcon.engine_api.types import RequestOutput
from gyrfalcon.errors import RequestError
from gyrfalcon.protocol.requests import ServingRequest
from gyrfalcon.protocol.rules import wire_param
from gyrfalcon.serving.formats import FORMATTERS, CompletionFormatter


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
            exc.param = wire_param(serving.endpoint, exc.param)
        raise
    return streams


def _raise_in_band(serving: ServingRequest, output: RequestOutput) -> None:
    if output.error is not None:
        error = output.error
        raise RequestError(error.message, wire_param(serving.endpoint, error.param), status=error.status, type=error.type)


#: status logged for a request whose client went away before its answer (nginx's convention)
CLIENT_CLOSED = 499


def complete(
    engine: Engine,
    serving: ServingRequest,
    streams: list[OutputStream],
    client_alive: Callable[[], bool] | None = None,
    poll_s: float = 0.25,
) -> dict[str, Any]:
    """Wait for every stream's final output and build the response body.

    ``client_alive`` (a cheap, non-blocking check of the client's connection) is asked whenever no
    output came for a moment; once the client is gone every stream is closed, which aborts the
    request's sequences in the engine within a step.
    """
    formatter = FORMATTERS[serving.endpoint](serving, engine)
    if serving.prompt_only:
        assert isinstance(formatter, CompletionFormatter)
        return formatter.prompt_only()
    finals: list[RequestOutput] = []
    try:
        for last in _last_outputs(serving, streams, client_alive, poll_s):
            if last is None or not last.finished:
                if client_alive is not None and not client_alive():
                    raise RequestError("The client closed the connection", None, status=CLIENT_CLOSED, type="client_closed")
                raise RequestError("The engine ended the request without a final output", None, status=500, type="engine_error")
            finals.append(last)
    finally:
        for stream in streams:
            stream.close()
    return formatter.final(finals)


def _last_outputs(
    serving: ServingRequest, streams: list[OutputStream], client_alive: Callable[[], bool] | None, poll_s: float
) -> list[RequestOutput | None]:
    """Each stream's last output (None: it ended without one, or the client left).

    Several streams (prompts) are read in turn, a short wait each, not one after the other: the
    client side of the engine turns a stream's token ids into text (and checks its stop strings,
    ending choices early) only as the stream is read.
    """
    if len(streams) == 1:
        last = None
        for output in streams[0] if client_alive is None else follow(streams[0], client_alive, poll_s):
            _raise_in_band(serving, output)
            last = output
        return [last]
    lasts: list[RequestOutput | None] = [None] * len(streams)
    reading = list(range(len(streams)))
    quiet_since = time.monotonic()
    while reading:
        for i in list(reading):
            try:
                output = streams[i].get(timeout=_TURN_S)
            except queue.Empty:
                continue
            quiet_since = time.monotonic()
            if output is None:
                reading.remove(i)
                continue
            _raise_in_band(serving, output)
            lasts[i] = output
        if client_alive is not None and time.monotonic() - quiet_since > poll_s:
            if not client_alive():
                break
            quiet_since = time.monotonic()
    return lasts


#: how long one stream is waited for before the next one's turn (several prompts in one request)
_TURN_S = 0.005


class StreamedResponse:
    """The chunks of a streamed response (an iterator of dicts).

    ``close()`` aborts whatever engine work is still running, even when iteration never started
    (a client that hangs up before the first event), which a plain generator's ``finally`` misses.
    """

    def __init__(self, chunks: Iterator[dict[str, Any]], streams: list[OutputStream]) -> None:
        self._chunks = chunks
        self._streams = streams

    def __iter__(self) -> StreamedResponse:
        return self

    def __next__(self) -> dict[str, Any]:
        return next(self._chunks)

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()
        for stream in self._streams:
            stream.close()


def stream_chunks(
    engine: Engine,
    serving: ServingRequest,
    streams: list[OutputStream],
    client_alive: Callable[[], bool] | None = None,
    poll_s: float = 0.25,
) -> StreamedResponse:
    """The response's SSE chunks; iterating raises :class:`RequestError` for an in-band error.

    Streams are read one after the other (their outputs queue up meanwhile); every choice's last
    chunk carries its ``finish_reason``. ``client_alive`` is asked whenever nothing arrived for
    ``poll_s`` (a queued request, text held back for a stop string): a client that is gone ends the
    response and aborts the work.
    """
    return StreamedResponse(_chunks(engine, serving, streams, client_alive, poll_s), streams)


def _chunks(
    engine: Engine,
    serving: ServingRequest,
    streams: list[OutputStream],
    client_alive: Callable[[], bool] | None,
    poll_s: float,
) -> Iterator[dict[str, Any]]:
    formatter = FORMATTERS[serving.endpoint](serving, engine)
    each = formatter.with_usage if serving.continuous_usage else (lambda chunk: chunk)
    prompt_tokens = completion_tokens = 0
    if serving.prompt_only:
        assert isinstance(formatter, CompletionFormatter)
        body = formatter.prompt_only()
        for choice in body["choices"]:  # one choice per chunk
            yield each(formatter.envelope([choice], chunk=True))
        if serving.include_usage:
            yield formatter.usage_chunk(body["usage"]["prompt_tokens"], 0)
        return
    try:
        for chunk in formatter.opening_chunks():
            yield each(chunk)
        for i, stream in enumerate(streams):
            finished = False
            for output in stream if client_alive is None else follow(stream, client_alive, poll_s):
                _raise_in_band(serving, output)
                formatter.count_generated(i, output)
                for chunk in formatter.delta_chunks(i, output):
                    yield each(chunk)
                if output.finished:
                    finished = True
                    prompt_tokens += len(output.prompt_token_ids)
                    completion_tokens += output.num_generated_tokens
            if not finished:
                if client_alive is not None and not client_alive():
                    return  # nobody is listening: the finally below aborts the rest
                raise RequestError("The engine ended the request without a final output", None, status=500, type="engine_error")
        if serving.include_usage:
            yield formatter.usage_chunk(prompt_tokens, completion_tokens)
    finally:
        for stream in streams:
            stream.close()
