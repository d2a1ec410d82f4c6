"""The engine interface: what the HTTP frontend may ask of an engine, and nothing more.

The frontend only ever talks to an :class:`Engine` through these methods with the plain data of
:mod:`gyrfalcon.engine_api.types`, so the engine may live in the same process (the transformers runner)
or behind a proxy in another (a Ray deployment, a vLLM adapter).
"""

from __future__ import annotations

import abc
import queue
import threading
from collections.abc import Iterator
from typing import Any

from gyrfalcon.engine_api.types import EngineHealth, EngineInfo, EngineRequest, RequestOutput
from gyrfalcon.errors import RequestError

__all__ = ["Engine", "OutputStream", "RequestError"]


class OutputStream:
    """Iterator over one request's :class:`RequestOutput` items; closing it aborts the request.

    The producer (an engine's step loop) calls :meth:`put` and finally :meth:`finish`; the consumer
    iterates. The last item has ``finished=True``. Iteration blocks until the next item arrives.
    """

    _END = object()

    def __init__(self, request_id: str, on_close: Any = None) -> None:
        self.request_id = request_id
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._on_close = on_close
        self._closed = False
        self._lock = threading.Lock()

    # producer side
    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def finish(self) -> None:
        self._queue.put(self._END)

    # consumer side
    def __iter__(self) -> Iterator[RequestOutput]:
        return self

    def _take(self, timeout: float | None) -> Any:
        """The next queued item (an output or the end marker); ``queue.Empty`` after ``timeout``."""
        return self._queue.get(timeout=timeout)

    def __next__(self) -> RequestOutput:
        item = self.get()
        if item is None:
            raise StopIteration
        return item

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output, None at the end; raises ``queue.Empty`` after ``timeout`` seconds."""
        if self._closed:
            return None
        item = self._take(timeout)
        if item is self._END:
            self._closed = True
            return None
        return item

    def close(self) -> None:
        """Stop consuming: the engine aborts the request (idempotent)."""
        with self._lock:
            if self._closed and self._on_close is None:
                return
            self._closed = True
            callback, self._on_close = self._on_close, None
        if callback is not None:
            callback(self.request_id)

    def __enter__(self) -> OutputStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Engine(abc.ABC):
    """An inference engine behind the HTTP frontend.

    Contract:
    - :meth:`info` is cheap and constant after start.
    - :meth:`submit` validates and enqueues synchronously: it raises :class:`RequestError`
      (queue full → 503 with a ``Retry-After`` header; too long or invalid → 400 with ``param``) before the
      frontend commits a status, otherwise returns the request's :class:`OutputStream`.
    - Outputs follow the request's ``output_kind``; FINAL_ONLY aggregation of every choice happens
      in the engine. Errors after acceptance arrive in-band (``RequestOutput.error``).
    - :meth:`abort` is idempotent and safe for unknown or finished ids.
    """

    @abc.abstractmethod
    def info(self) -> EngineInfo: ...

    @abc.abstractmethod
    def submit(self, request: EngineRequest) -> OutputStream: ...

    @abc.abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def health(self) -> EngineHealth: ...

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for /metrics: running, waiting, finished requests, generated tokens, …"""

    @abc.abstractmethod
    def shutdown(self, grace: float = 5.0) -> None:
        """Stop accepting, let running requests finish for up to ``grace`` seconds, abort the rest."""

    # Text helpers: the engine owns the tokenizer (detokenisation and stop strings live here, as in
    # vLLM), and the frontend uses these to turn prompts and messages into token ids.
    @abc.abstractmethod
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @abc.abstractmethod
    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...

    @abc.abstractmethod
    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The text of each token on its own (for logprob entries)."""

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """The raw bytes of each token (chat logprob ``bytes``); a byte-level token may be part of
        a character. Default: the UTF-8 of :meth:`token_strings`; engines with a tokenizer override
        it with the tokenizer's byte mapping."""
        return [text.encode("utf-8") for text in self.token_strings(token_ids)]

    @abc.abstractmethod
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render plain ``{role, content, name?}`` messages with the model's chat template."""
