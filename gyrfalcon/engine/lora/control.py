"""The engine's LoRA adapters at run time (``--enable-lora``), mixed into the engine: the registry
made once the model is loaded (the adapters of ``--lora-modules`` read then: one that cannot serve
fails the load), an adapter loaded or unloaded while serving (vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``), the adapter a request names checked at submit and put in a slot when
the scheduler admits the request."""

from __future__ import annotations

from typing import Any

from gyrfalcon.engine.lora.peft import AdapterError
from gyrfalcon.engine.lora.registry import LoraRegistry
from gyrfalcon.engine_api.config import LoraConfig
from gyrfalcon.engine_api.types import EngineError, EngineRequest
from gyrfalcon.errors import Kind, RequestError


class LoraControl:
    """Mixed into :class:`~gyrfalcon.engine.transformers_engine.TransformersEngine` (its lock, live
    requests, gate, scheduler and failure path)."""

    #: the adapters held (None: ``--enable-lora`` is off)
    lora: LoraRegistry | None = None

    def _make_lora(self, runner: Any) -> None:
        """Once the model is loaded: the registry the load made (:func:`~gyrfalcon.engine.setup.load_runner`),
        with the start-up adapters in it, and the scheduler asking it for each request's adapter
        before admitting it."""
        config = LoraConfig.of(self.engine_config)
        if not config.enable_lora:
            return
        if runner.lora_registry is None:
            raise ValueError(f"--enable-lora needs the direct forward, and this model runs {runner.model_impl}")
        self.lora = runner.lora_registry
        for name, path in config.modules().items():
            self.lora.load(name, path)
        self.scheduler.admission_check = self._admit_adapter

    def _check_adapter(self, request: EngineRequest) -> None:
        """A 404 naming ``model`` when ``request`` names an adapter not loaded."""
        if request.lora_name is not None and (self.lora is None or not self.lora.known(request.lora_name)):
            raise RequestError(f"The model `{request.lora_name}` does not exist.", "model", type=Kind.NOT_FOUND)

    def _admit_adapter(self, state: Any) -> bool | None:
        """(The scheduler, before admitting ``state``) its adapter in a slot, its sequences running
        with it: True; False while every slot holds an adapter of a running request (it waits);
        None when the adapter cannot serve any more (its folder changed or went): the request ends
        with that error."""
        name = state.request.lora_name
        if name is None or self.lora is None:
            return True
        in_use = frozenset(seq.lora.serial for running in self.scheduler.running for seq in running.sequences
                           if seq.lora is not None)  # fmt: skip
        try:
            adapter = self.lora.acquire(name, in_use)
        except AdapterError as exc:
            if self.scheduler.remove(state.request.request_id) is not None:
                self._fail(state, EngineError(str(exc), type=Kind.NOT_FOUND if not exc.found else Kind.INVALID,
                                              param="model"))  # fmt: skip
            return None
        if adapter is None:
            return False
        for seq in state.sequences:
            seq.lora = adapter
        return True

    def _registry(self, param: str) -> LoraRegistry:
        if self.lora is None:
            raise RequestError("LoRA adapters are not served here (start the server with --enable-lora)", param)
        return self.lora

    def load_lora_adapter(self, lora_name: str, lora_path: str, load_inplace: bool = False) -> None:
        registry = self._registry("lora_name")
        with self._lock:  # the adapters requests still run with keep their slots
            in_use = frozenset(seq.lora.serial for state in self._live.values() for seq in state.sequences
                               if seq.lora is not None)  # fmt: skip
        try:
            registry.load(lora_name, lora_path, replace=load_inplace, in_use=in_use)
        except AdapterError as exc:
            raise _refusal(exc) from None

    def unload_lora_adapter(self, lora_name: str) -> None:
        registry = self._registry("lora_name")
        try:
            registry.unload(lora_name)
        except AdapterError as exc:
            raise _refusal(exc) from None
        with self._lock:  # what waits for it ends now; what runs finishes with the adapter it holds
            waiting = [self._gate.release(rid) or self.scheduler.remove(rid)
                       for rid, state in list(self._live.items()) if state.request.lora_name == lora_name]  # fmt: skip
        for state in filter(None, waiting):
            self._fail(state, EngineError(f"the LoRA adapter '{lora_name}' was unloaded before the request ran",
                                          type=Kind.NOT_FOUND, param="model"))  # fmt: skip

    def _lora_stats(self) -> dict[str, Any]:
        """For ``/metrics``' ``lora_requests_info`` (vLLM's): the adapters of the running requests and
        of the waiting ones (comma-separated names), and ``--max-loras``; empty without the flag."""
        if self.lora is None:
            return {}
        with self._lock:
            running = {id(state) for state in self.scheduler.running}
            named = [(state.request.lora_name, id(state) in running) for state in self._live.values()
                     if state.request.lora_name is not None]  # fmt: skip
        return {"lora_running_adapters": ",".join(sorted({n for n, runs in named if runs})),
                "lora_waiting_adapters": ",".join(sorted({n for n, runs in named if not runs})),
                "lora_max": self.lora.max_loras}  # fmt: skip

    def lora_adapters(self) -> list[list[str]]:
        return [] if self.lora is None else [[name, path] for name, path in self.lora.held()]


def _refusal(exc: AdapterError) -> RequestError:
    """An adapter's refusal as a request's: a 404 for what is not there, else a 400, naming the field."""
    return RequestError(str(exc), exc.param, **({} if exc.found else {"type": Kind.NOT_FOUND}))
