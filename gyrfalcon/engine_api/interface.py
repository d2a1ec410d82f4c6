"""The engine interface: what the HTTP frontend may ask of an engine, and nothing more.

The frontend only ever talks to an :class:`Engine` through these methods with the plain data of
:mod:`gyrfalcon.engine_api.types`. An :class:`EngineCore` deals in token ids only; the API side's
:class:`gyrfalcon.client.EngineClient` makes an ``Engine`` of one, wherever it runs: in the same
process (the transformers engine), in the engine process (:mod:`gyrfalcon.engine_process`) or in
Ray replicas (:mod:`gyrfalcon.ray`).
"""

from __future__ import annotations

import abc
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from gyrfalcon.engine_api.types import EngineHealth, EngineInfo, EngineRequest, PauseState, RequestOutput, SleepState
from gyrfalcon.errors import RequestError

__all__ = ["Engine", "EngineCore", "OutputStream", "RequestError"]


class OutputStream:
    """Iterator over one request's :class:`RequestOutput` items; closing it aborts the request.

    The producer (an engine's step loop) calls :meth:`put` and finally :meth:`finish`; the consumer
    iterates. The last item has ``finished=True``. Iteration blocks until the next item arrives; an
    asyncio consumer instead sets a waker (:meth:`set_waker`) and takes what is ready with
    ``get(timeout=0)``.
    """

    _END = object()

    def __init__(self, request_id: str, on_close: Any = None) -> None:
        self.request_id = request_id
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._on_close = on_close
        self._closed = False
        self._lock = threading.Lock()
        self._waker: Callable[[], None] | None = None

    # producer side
    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)
        self._wake()

    def finish(self) -> None:
        self._queue.put(self._END)
        self._wake()

    def _wake(self) -> None:
        waker = self._waker
        if waker is not None:
            waker()

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """Have ``waker()`` called, in the producer's thread, after every item put and at the end
        (None: no more calls). It must be cheap and must not block; an asyncio reader passes a
        function that wakes its task from another thread."""
        self._waker = waker

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


class EngineCore(abc.ABC):
    """An inference engine core: token ids in, token ids out (no text).

    Contract:
    - :meth:`info` is cheap and constant after start.
    - :meth:`submit` trusts a request that passed :class:`gyrfalcon.validation.RequestValidator`
      and enqueues it synchronously: it raises :class:`gyrfalcon.errors.RequestError` only for
      what only it knows (its KV cache can never hold the request; the id is already running) and
      :class:`gyrfalcon.engine_api.errors.EngineUnavailable` (queue full, shutting down) before the
      frontend commits a status, otherwise returns the request's :class:`OutputStream`.
    - Outputs follow the request's ``output_kind`` and carry token ids (and logprobs); errors after
      acceptance arrive in-band (``RequestOutput.error``).
    - :meth:`abort` is idempotent and safe for unknown or finished ids; :meth:`finish_choice` ends
      one choice (its text hit a stop string) at the next step.
    """

    @abc.abstractmethod
    def info(self) -> EngineInfo: ...

    @abc.abstractmethod
    def submit(self, request: EngineRequest) -> OutputStream: ...

    @abc.abstractmethod
    def abort(self, request_id: str) -> None: ...

    def finish_choice(self, request_id: str, index: int, stop_reason: str | int | None = None) -> None:
        """End choice ``index`` with ``"stop"`` (default: nothing; the client drops what follows)."""

    @abc.abstractmethod
    def health(self) -> EngineHealth: ...

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for /metrics: running, waiting, finished requests, generated tokens, …"""

    @abc.abstractmethod
    def shutdown(self, grace: float = 5.0) -> None:
        """Stop accepting, let running requests finish for up to ``grace`` seconds, abort the rest."""

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> PauseState:
        """Pause generation (returns at once; :meth:`pause_state` says when it has settled): requests
        submitted from now on wait for :meth:`resume` (counted against the queue's capacity), and
        those submitted before are treated as ``mode`` says (``types.PAUSE_MODES``). ``clear_cache``
        (not with ``keep``): the prefix cache forgets every block once nothing runs. Default: a 400,
        this engine cannot pause."""
        raise RequestError("pausing is not supported by this server's engine", None)

    def resume(self) -> PauseState:
        """Generation continues: what a ``keep`` pause froze, then what was held, in order."""
        raise RequestError("pausing is not supported by this server's engine", None)

    def pause_state(self) -> PauseState:
        """Whether generation is paused, and whether that has settled (:class:`PauseState`)."""
        return PauseState()

    def abort_requests(self, group_ids: list[str] | None = None) -> int:
        """Abort every running or waiting request whose ``group_id`` is one of ``group_ids`` (None:
        every request), its choices ending with ``"abort"``; the number of requests aborted."""
        raise RequestError("aborting requests by id is not supported by this server's engine", None)

    def update_weights(self, model_path: str, weight_version: str | None = None, flush_cache: bool = True) -> str:
        """Serve the weights at ``model_path`` (a folder of the served model's architecture, or a
        GGUF of its shape), loaded and checked tensor by tensor before anything changes (a
        :class:`RequestError` naming ``model_path`` for any mismatch, the served weights untouched),
        then copied in between two steps: running choices go on with them, their outputs saying
        from which token on (``CompletionOutput.weight_versions``); prefixes cached before are never found
        again (the prefix cache is keyed by the weights that computed each chain from its first block).
        ``flush_cache``: the prefix cache also forgets every block at the swap. Returns the new
        version (``weight_version``, or ``update-N``). Default: a 400."""
        raise RequestError("updating the weights is not supported by this server's engine", None)

    def sleep(self, level: int = 1) -> SleepState:
        """Hand memory back to the system between rollout phases (returns at once;
        :meth:`sleep_state` says when it has settled): ``level`` 1 the KV cache's, 2 the weights'
        too (``types.SLEEP_LEVELS``). Requests submitted from now on wait for the wake (as under
        a ``wait`` pause, made by the sleep when generation was running); what runs ends first,
        and cached prefixes are forgotten. Default: a 400, this engine cannot sleep."""
        raise RequestError("sleeping is not supported by this server's engine", "level")

    def wake_up(self, tags: list[str] | None = None) -> SleepState:
        """Take back the parts ``tags`` name (``types.WAKE_TAGS``; None: all), returning once they
        serve: the KV cache zeroed, the weights loaded again from where they last came from. Once
        every part is back, the pause the sleep made ends. Default: a 400."""
        raise RequestError("sleeping is not supported by this server's engine", "tags")

    def sleep_state(self) -> SleepState:
        """Whether the engine sleeps, and which parts (:class:`SleepState`)."""
        return SleepState()

    def load_lora_adapter(self, lora_name: str, lora_path: str, load_inplace: bool = False) -> None:
        """Hold the LoRA adapter of the PEFT folder ``lora_path`` as ``lora_name``, serving it to
        requests that name it while the rest runs on (a :class:`RequestError` naming ``lora_name`` or
        ``lora_path`` for what cannot serve: nothing held changes then); ``load_inplace``: an adapter of
        that name is replaced (requests running with it finish with it). Default: a 400."""
        raise RequestError("LoRA adapters are not served by this server's engine", "lora_name")

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving ``lora_name``: requests of it that wait end with an error naming it, those
        that run finish with it (a 404 :class:`RequestError` when none of that name is held). Default: a 400."""
        raise RequestError("LoRA adapters are not served by this server's engine", "lora_name")

    def lora_adapters(self) -> list[list[str]]:
        """The adapters held: ``[name, path]`` each (none by default)."""
        return []

    def drain(self, timeout: float) -> None:
        """The server is stopping (SIGTERM): return at once, having stopped admitting — health turns
        503, new requests are refused with :class:`gyrfalcon.engine_api.errors.ShuttingDown`, queued
        ones end at once with an in-band 503 error (``retry_after`` set); running requests may
        finish for ``timeout`` seconds, then end with that error too. Default: nothing (the
        server's :meth:`shutdown` then aborts what is left)."""


class Engine(EngineCore):
    """What the HTTP frontend talks to: an engine core plus the text work of the API side
    (:class:`gyrfalcon.client.EngineClient`): outputs carry text, and prompts and messages are
    turned into token ids here."""

    @abc.abstractmethod
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @abc.abstractmethod
    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...

    @abc.abstractmethod
    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The text of each token on its own (for logprob entries)."""

    def token_pieces(self, token_ids: list[int]) -> list[str]:
        """The tokenizer's own string of each token (``convert_ids_to_tokens``: vLLM's
        ``token_strs``, e.g. ``"Ġhello"``). Default: :meth:`token_strings`."""
        return self.token_strings(token_ids)

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """The raw bytes of each token (chat logprob ``bytes``); a byte-level token may be part of
        a character. Default: the UTF-8 of :meth:`token_strings`."""
        return [text.encode("utf-8") for text in self.token_strings(token_ids)]

    def longest_token_chars(self) -> int | None:
        """The most characters of text one token can stand for (so a text longer than the context
        times this cannot fit it, and is refused before it is tokenized); None: unknown (no bound)."""
        return None

    @abc.abstractmethod
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> str:  # fmt: skip
        """Render plain ``{role, content, name?}`` messages with the model's chat template;
        ``continue_final_message`` leaves the last message open; ``template_kwargs`` are extra
        template variables."""
