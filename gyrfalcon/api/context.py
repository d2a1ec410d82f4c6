"""What every resource shares: the engine, the settings, the plugins, and what is derived from them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import falcon.asgi
import orjson
import pluggy

from gyrfalcon.api.body import check_json_headers, read_raw
from gyrfalcon.api.spec import (
    TemplateSupport,
    bounded_extensions,
    chat_template_overhead,
    deployment_spec,
    kv_cache_limits,
    unspellable_bytes,
)
from gyrfalcon.config import Settings
from gyrfalcon.engine_api.interface import Engine
from gyrfalcon.api.response_store import PURGE_INTERVAL_S, ResponseStore
from gyrfalcon.engine_api.types import EngineInfo
from gyrfalcon.errors import Kind, RequestError
from gyrfalcon.plugins import merged_dict
from gyrfalcon.protocol.translate import Translator
from gyrfalcon.validation import RequestValidator

log = logging.getLogger(__name__)


#: the stored responses' file in the cache folder (in a folder of its own: 0700)
RESPONSES_FILE = "responses/responses.sqlite3"


def _purge_every(store: ResponseStore, interval_s: float) -> None:
    """Purge ``store``'s expired responses every ``interval_s`` seconds (a daemon thread)."""
    while True:
        time.sleep(interval_s)
        try:
            store.purge()
        except Exception:  # noqa: BLE001 - a busy or closed file: the next round tries again
            log.warning("purging the stored responses failed", exc_info=True)


T = TypeVar("T")

#: the large-body lane's nice value: the lowest priority, so the engine's threads beside it take
#: a core from it at once rather than sharing it (on 2 cores, a lane busy a third of the time
#: made the engine's other requests' median latency 1.8x, 1.4x at this priority: a step waits for
#: every one of the engine's threads)
LARGE_BODY_NICE = 19


def _yield_the_cpu() -> None:
    """Lower the calling thread's CPU priority to :data:`LARGE_BODY_NICE` (Linux: a thread's own nice)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LARGE_BODY_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: the lane is paced all the same
        log.debug("could not lower the large-body lane's priority", exc_info=True)

#: bodies larger than this (64 KiB) are parsed and translated in a lane of their own
#: (:meth:`ServerContext.in_body_lane`)
LARGE_BODY_BYTES = 64 << 10
#: after each large body, its lane rests this many times the CPU the body took: at most a quarter of
#: a core goes to large bodies, whatever a client sends
LARGE_BODY_REST = 3.0


class ServerContext:
    """Holds the engine, the stored responses and, once the model is ready, the translator and the
    served spec (:meth:`prepare`)."""

    def __init__(self, engine: Engine, settings: Settings, pm: pluggy.PluginManager) -> None:
        self.engine = engine
        self.settings = settings
        self.pm = pm
        self.started = int(time.time())
        self.served_model_names = settings.served_names()
        self.extension_schemas: dict[str, dict[str, Any]] = merged_dict(
            pm.hook.gyrfalcon_request_extensions(), "request extension"
        )
        self._lock = threading.Lock()
        self._translator: Translator | None = None
        self._spec: bytes | None = None
        self._store: ResponseStore | None = None
        self._large_bodies = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gyrfalcon-large-bodies")
        self._lane_yields = False

    async def in_body_lane(self, raw: bytes, fn: Callable[[], T]) -> T:
        """``fn()`` (the parsing, translation and submission of body ``raw``) in a worker thread: the
        event loop's pool, or for a body over :data:`LARGE_BODY_BYTES` one thread of its own, paced.
        Large bodies cost tens of ms each (a 20,000-key logit_bias 150 ms, a 1 MB schema 40 ms): six
        sent at once held every thread of the pool, and on 2 cores their parsing took a core from the
        engine's threads. In their lane they wait for each other, and after each one the lane rests
        :data:`LARGE_BODY_REST` times the CPU it took (the body itself is answered at once)."""
        loop = asyncio.get_running_loop()
        if len(raw) <= LARGE_BODY_BYTES:
            return await loop.run_in_executor(None, fn)

        def paced() -> T:
            if not self._lane_yields:
                self._lower_the_lanes_priority()
            start = time.thread_time()
            try:
                return fn()
            finally:
                self._large_bodies.submit(time.sleep, LARGE_BODY_REST * (time.thread_time() - start))

        return await loop.run_in_executor(self._large_bodies, paced)

    def _lower_the_lanes_priority(self) -> None:
        """In the large-body lane, once the engine is ready: start the pools that libraries start on
        first use (the tokenizer's threads), whose threads would otherwise inherit the lane's
        priority for good, then lower the lane's (:data:`LARGE_BODY_NICE`). Threads it starts later
        (the stored responses' purge) run at its priority, as befits their work."""
        try:
            if not self.engine.health().ready:
                return
            self.engine.tokenize("start the tokenizer's thread pool " * 64)
        except Exception:  # noqa: BLE001 - the body's own work says what is wrong; the next body tries again
            log.debug("the large-body lane keeps its priority for now", exc_info=True)
            return
        _yield_the_cpu()
        self._lane_yields = True

    def response_store(self) -> ResponseStore:
        """The stored responses (one SQLite file in the cache folder, shared by every API worker)."""
        if self._store is None:
            with self._lock:
                if self._store is None:
                    from gyrfalcon.models.default import cache_root

                    path = cache_root(self.settings.cache_dir) / RESPONSES_FILE
                    self._store = ResponseStore(path, self.settings.responses_store_size, self.settings.responses_ttl)
                    threading.Thread(target=_purge_every, args=(self._store, PURGE_INTERVAL_S), daemon=True,
                                     name="gyrfalcon-responses-purge").start()  # fmt: skip
        return self._store

    def prepare(self) -> None:
        """Open the stored responses, and build the translator and the served spec if the engine is
        ready: the composition root's start-up (:func:`gyrfalcon.compose.app`), so that no request
        pays for them and what they hold is among the worker's long-lived objects when it freezes
        them. With an engine still loading, the translator and spec are built on first use instead
        (until then a request gets 503)."""
        self.response_store()
        if self.engine.health().ready:
            self.translator()
            self.served_spec_bytes()

    def ready_info(self) -> EngineInfo:
        """The engine's info, or a 503 while the model is still loading."""
        health = self.engine.health()
        if not health.ready:
            raise RequestError(health.message or "The model is loading", type=Kind.NOT_READY, retry_after=1)
        return self.engine.info()

    def translator(self) -> Translator:
        if self._translator is None:
            self.ready_info()
            with self._lock:
                if self._translator is None:
                    extensions = bounded_extensions(self.extension_schemas, self.engine.info())
                    self._translator = Translator(
                        self.engine,
                        self.served_model_names,
                        extensions,
                        RequestValidator.of(self.pm, self.engine.info()),
                        max_prompts=self.settings.max_request_prompts,
                        max_seqs=self.settings.max_request_seqs,
                        max_work=self.settings.request_tokens(self.engine.info().max_model_len),
                        tool_parser=merged_dict(self.pm.hook.gyrfalcon_tool_parsers(), "tool-call parser").get(
                            self.settings.tool_call_parser),
                        weight_versions=self.settings.enable_rl_endpoints,
                    )
        return self._translator

    async def read_body(self, req: falcon.asgi.Request) -> bytes:
        """A request's JSON body, unparsed, within this server's byte and time limits."""
        check_json_headers(req, self.settings.max_body_bytes)
        return await read_raw(req, self.settings.max_body_bytes, self.settings.client_body_timeout)

    def served_spec_bytes(self) -> bytes:
        if self._spec is None:
            info = self.ready_info()
            spec = deployment_spec(
                info,
                self.served_model_names,
                self.extension_schemas,
                chat_template_overhead(self.engine),
                max_prompts=self.settings.max_request_prompts,
                max_seqs=self.settings.max_request_seqs,
                template=TemplateSupport.probe(self.engine),
                kv_cache=kv_cache_limits(self.engine.stats()),
                unspellable=unspellable_bytes(self.engine, info.vocab_size),
                responses_store={"size": self.settings.responses_store_size, "ttl_s": self.settings.responses_ttl},
                max_text_chars=self.translator().max_text_chars,
                max_request_tokens=self.translator().max_work,
                control_routes=self.settings.enable_rl_endpoints,
                lora_routes=self.settings.enable_lora,
            )
            self._spec = orjson.dumps(spec)
        return self._spec
