"""What every resource shares: the engine, the settings, the plugins, and what is derived from them."""

from __future__ import annotations

import threading
import time
from typing import Any

import falcon
import orjson
import pluggy

from gyrfalcon.api.body import read_json
from gyrfalcon.api.errors import APIError
from gyrfalcon.api.spec import (
    TemplateSupport,
    bounded_extensions,
    chat_template_overhead,
    deployment_spec,
    kv_cache_limits,
)
from gyrfalcon.config import Settings
from gyrfalcon.engine_api.interface import Engine
from gyrfalcon.engine_api.types import EngineInfo
from gyrfalcon.plugins import merged_dict
from gyrfalcon.protocol.translate import Translator


class ServerContext:
    """Holds the engine and builds, once the model is ready, the translator and the served spec."""

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

    def ready_info(self) -> EngineInfo:
        """The engine's info, or a 503 while the model is still loading."""
        health = self.engine.health()
        if not health.ready:
            raise APIError(503, health.message or "The model is loading", headers={"Retry-After": "1"})
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
                        self.pm.hook.gyrfalcon_validate_request,
                        max_prompts=self.settings.max_request_prompts,
                        max_seqs=self.settings.max_request_seqs,
                    )
        return self._translator

    def read_body(self, req: falcon.Request) -> Any:
        """A request's JSON body within this server's byte and array limits."""
        return read_json(req, self.settings.max_body_bytes, lambda: self.translator().max_array_items)

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
            )
            self._spec = orjson.dumps(spec)
        return self._spec
