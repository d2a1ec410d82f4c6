"""``TransformersEngine``: the engine core running a transformers causal LM with continuous batching
(token ids only: the API side's :class:`gyrfalcon.client.EngineClient` does the text work, in
this process or across the engine process's socket).

Construction is quick (the model folder's config and tokenizer, :func:`gyrfalcon.engine.setup.read_model`);
a background thread then loads and warms up the model (:func:`gyrfalcon.engine.setup.load_runner`:
weights in the kernels of ``--quantization``, the paged KV cache sized and allocated, the decode
path prepared and checked against the eager step: ``decode_path``) and runs the step loop
(:class:`gyrfalcon.engine.batcher.Batcher`): newcomers wait in a bounded queue and are prefilled in
chunks that share forwards with the running sequences' decode tokens; finished sequences leave at
once. ``health()`` answers ``ready=False`` with ``"loading model"`` until the loop runs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

import torch

from gyrfalcon.engine.batcher import Batcher
from gyrfalcon.engine_api.interface import EngineCore, OutputStream
from gyrfalcon.engine.model.fast_check import DecodePath
from gyrfalcon.engine.model.runner import ModelRunner
from gyrfalcon.engine.control import ControlPlane
from gyrfalcon.engine.lora.control import LoraControl
from gyrfalcon.engine.pause import PauseGate
from gyrfalcon.engine.sleep import Sleep
from gyrfalcon.engine.weights import WeightUpdates
from gyrfalcon.engine.request_state import RequestState, choices_of
from gyrfalcon.engine.sample.sampler import Sampler
from gyrfalcon.engine.scheduler import Scheduler
from gyrfalcon.engine.setup import capture_mode, engine_info, load_runner, read_model
from gyrfalcon.engine.step_health import StepFailures
from gyrfalcon.engine_api.streams import CoalescingOutputStream
from gyrfalcon.engine_api.types import EngineError, EngineHealth, EngineInfo, EngineRequest, OutputKind
from gyrfalcon.engine_api.config import EngineConfig, SpeculativeConfig
from gyrfalcon.engine.spec.draft_model import DraftModel
from gyrfalcon.engine.spec.drafter import Drafter
from gyrfalcon.engine_api.errors import SHUTTING_DOWN, ShuttingDown
from gyrfalcon.errors import RequestError
from gyrfalcon.heap import QuietTrimmer
from gyrfalcon.kernels import native
from gyrfalcon.models.loading import resolve_device, resolve_dtype, resolve_quantization

log = logging.getLogger(__name__)

#: most prompt tokens of one sequence per step: a longer prompt is prefilled in chunks, each
#: sharing a forward with the running sequences' decode tokens
PREFILL_CHUNK_TOKENS = 512

#: seconds one step may run before health reports the step loop hung (a step is at most
#: max_num_batched_tokens tokens: seconds on a CPU, milliseconds on a GPU)
STEP_STALL_S = 60.0


class TransformersEngine(ControlPlane, LoraControl, EngineCore):
    """An :class:`EngineCore` over a local Hugging Face causal-LM folder (token ids only; the
    factory wraps it in an :class:`gyrfalcon.client.EngineClient` for the frontend).

    ``config``: the model folder, limits, seed, dtype, device, threads, KV cache. ``pm``: the plugin
    manager whose engine hooks (logits processors, logprob gatherers) are resolved once here.
    ``start=False`` leaves the background thread to :meth:`start` (tests).
    """

    def __init__(self, config: EngineConfig, pm: Any, *, start: bool = True):
        self.engine_config = cfg = config
        self.model_path = str(config.model)
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.quantization = resolve_quantization(cfg.quantization, self.model_path, self.dtype, self.device)
        #: the decode steps' fast path (see gyrfalcon.engine.model.captured)
        self.capture = capture_mode(cfg, self.device)
        facts = read_model(self.model_path, cfg)
        self.config, self.eos_token_ids = facts.config, facts.eos_token_ids
        self._info, self.processors, self.gatherers = engine_info(cfg, facts, self.dtype, self.device, self.quantization, pm)

        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self._seeds = torch.Generator().manual_seed(cfg.seed)  # seeds of unseeded choices (CPU)
        self.sampler = Sampler(self.processors, self.gatherers, self.eos_token_ids, self.generator, cfg.logprobs_mode)
        speculative = SpeculativeConfig.parse(cfg.speculative_config)
        #: the draft tokens of sequences that speculate (``--speculative-config``; None: off)
        self.drafter = None if speculative is None else Drafter(speculative, self._info.max_model_len)
        self.speculative = ""  # as it serves, once loaded (setup._speculation)
        self.scheduler = Scheduler(cfg.max_queue_len, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   PREFILL_CHUNK_TOKENS, policy=cfg.scheduling_policy)  # fmt: skip
        self.runner: ModelRunner | None = None
        #: which path decode steps take, and why (known once the model is loaded)
        self.decode_path = DecodePath("eager", "loading model")
        self.cache_plan = None  # gyrfalcon.engine.kv.cache.CachePlan, once loaded
        self.batcher: Batcher | None = None
        self._lock = threading.Lock()
        self._live: dict[str, RequestState] = {}
        self._accepting = True
        self._gate = PauseGate()
        self._weights = WeightUpdates(self.model_path)
        self._sleep = Sleep()
        #: monotonic time at which running requests are cut short (drain); None: not draining
        self._cut_at: float | None = None
        self._stop = threading.Event()
        # steps failing in a row (health says so); the heap handed back once the loop is quiet
        self._failures, self._trimmer = StepFailures(), QuietTrimmer()
        self._step_started: float | None = None  # when the step running now began (the loop's heartbeat)
        self._health = EngineHealth(ready=False, message="loading model")
        self._counters = dict.fromkeys(
            ("requests_submitted", "requests_finished", "requests_aborted", "requests_failed",
             "prompt_tokens", "generation_tokens", "steps", "prefill_forwards", "decode_forwards"), 0)  # fmt: skip
        self._thread = threading.Thread(target=self._main, name="gyrfalcon-engine", daemon=True)
        if start:
            self.start()

    # ------------------------------------------------------------------ Engine API

    def start(self) -> None:
        """Start the background thread (load, warm up, step loop)."""
        if not self._thread.is_alive():
            self._thread.start()

    def info(self) -> EngineInfo:
        return self._info

    def health(self) -> EngineHealth:
        started = self._step_started
        if started is not None and self._health.ready and time.monotonic() - started > STEP_STALL_S:
            return EngineHealth(ready=False, message=f"the step loop is stuck: one step has run for "
                                                     f"{time.monotonic() - started:.0f} s")  # fmt: skip
        return self._failures.health(self._health)

    def wait_ready(self, timeout: float = 60.0) -> EngineHealth:
        """Block until the model is loaded and warmed up (or failed); returns the health."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._health.ready and self._thread.is_alive():
            time.sleep(0.01)
        return self._health

    def submit(self, request: EngineRequest) -> OutputStream:
        # the request was validated before (gyrfalcon.validation): only what only the engine knows is checked here
        params = request.sampling
        self.scheduler.check_fits(len(request.prompt_token_ids), params.max_tokens, params.n)
        self._check_adapter(request)
        for processor in self.processors:
            if processor.wants(params, request.extensions):
                processor.prepare(params, request.extensions)
        stream = CoalescingOutputStream(request.request_id, request.output_kind, on_close=self.abort)
        sequences = choices_of(request, self.eos_token_ids, self._info.max_model_len, self._seeds, self._weights.version)
        state = RequestState(request, stream, sequences)
        with self._lock:
            if not self._accepting:
                why = self._health.message or "the engine is shutting down"
                raise ShuttingDown(why)
            if request.request_id in self._live:
                raise RequestError(f"request id {request.request_id!r} is already running", "request_id")
            if not self._gate.hold(state, self.scheduler.max_queue_len - len(self.scheduler) - len(self._gate.held)):
                self.scheduler.add(state)
            self._live[request.request_id] = state
            self._counters["requests_submitted"] += 1
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            state = self._live.get(request_id)
            if state is None:
                return
            state.abort_requested = True
            waiting = self._gate.release(request_id) or self.scheduler.remove(request_id)
        if waiting is not None:
            waiting.abort()
            self._emit(waiting)

    def finish_choice(self, request_id: str, index: int, stop_reason: str | int | None = None) -> None:
        with self._lock:
            state = self._live.get(request_id)
            if state is not None and 0 <= index < len(state.sequences):
                state.finish_requested[index] = stop_reason

    def stats(self) -> dict[str, Any]:
        batcher = self.batcher
        with self._lock:
            stats: dict[str, Any] = dict(self._counters)
            stats["waiting"] = len(self.scheduler)
        stats["running"] = 0 if batcher is None else batcher.running_requests()
        stats["running_sequences"] = 0 if batcher is None else batcher.running_sequences
        stats["prefilling"] = 0 if batcher is None else batcher.prefilling_requests()
        if self.scheduler.pool is not None:
            stats.update(self.scheduler.pool.stats())
        stats["preemptions"] = self.scheduler.preemptions
        if self.drafter is not None:
            stats.update(self.drafter.stats())
        stats.update(self._lora_stats())
        stats["decode_path"] = self.decode_path.describe()
        stats["pid"] = os.getpid()  # the worker process, for memory checks (bench reads its /proc status)
        return stats

    def shutdown(self, grace: float = 5.0) -> None:
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + max(grace, 0.0)
        while time.monotonic() < deadline and self._live and self._thread.is_alive():
            time.sleep(0.01)
        with self._lock:
            ids = list(self._live)
        for request_id in ids:
            self.abort(request_id)
        self._stop.set()
        self.scheduler.wake()
        if self._thread.is_alive():
            self._thread.join(timeout=max(grace, 1.0) + 5.0)
        elif self.batcher is not None:  # stepped by hand (tests): finish what it holds
            self.batcher.abort_all()
        for state in self.scheduler.drain():  # the loop never ran (load failure or not started)
            state.abort()
            self._emit(state)
        self._health = EngineHealth(ready=False, message="shut down")

    def drain(self, timeout: float) -> None:
        with self._lock:
            self._accepting = False
            self._health = EngineHealth(ready=False, message="the server is shutting down")
            self._cut_at = time.monotonic() + max(timeout, 0.0)
            held, self._gate.held = self._gate.held, []
        for state in [*held, *self.scheduler.drain()]:
            self._fail(state, SHUTTING_DOWN)
        self.scheduler.wake()

    # ------------------------------------------------------------------ internals

    def _emit_step(self, states: list[RequestState]) -> None:
        """Send what a step produced, for every request it changed."""
        for state in states:
            self._emit(state)

    def _emit(self, state: RequestState) -> None:
        """Send what a step produced for one request; end the stream and forget the request once it
        has finished."""
        output = state.make_output()
        # read before the output goes out: a client that closes its stream once it has the final
        # output (an abort of a finished request) must not turn it into an aborted one
        aborted = state.abort_requested
        if output is not None:
            if state.scheduled_at is not None and not state.queue_time_sent:
                output.queue_time = state.scheduled_at - state.submitted_at
                state.queue_time_sent = True
            state.stream.put(output)
        if state.finished and not state.closed:
            state.closed = True
            state.stream.finish()
            self._forget(state, "requests_aborted" if aborted else "requests_finished")

    def _forget(self, state: RequestState, counter: str) -> None:
        with self._lock:
            self._live.pop(state.request_id, None)
            self._counters[counter] += 1

    def _count(self, name: str, value: int) -> None:
        with self._lock:
            self._counters[name] += value

    def prepare(self) -> bool:
        """Load and warm up the model and build the batcher on the calling thread; False on failure.

        The background thread calls this before its loop; tests that drive ``batcher.step()`` by
        hand call it on an engine built with ``start=False`` (and never start it).
        """
        try:
            self._load()
        except Exception as exc:  # noqa: BLE001 - reported through health and in-band errors
            log.exception("model failed to load")
            with self._lock:  # no submit may slip in between this and the drain below
                self._health = EngineHealth(ready=False, message=f"model failed to load: {exc}")
                self._accepting = False
            for state in self.scheduler.drain():
                self._fail(state, f"model failed to load: {exc}")
            return False
        assert self.runner is not None
        # looked up at each call: a test replaces the sampler's method
        prompt_logprobs = lambda request, logits, start: self.sampler.gather_prompt_logprobs(logits, request, start)  # noqa: E731
        self.batcher = Batcher(self.runner, self.sampler, self.scheduler, self._emit_step, self._count, self._fail,
                               prompt_logprobs, self.drafter)  # fmt: skip
        self._health = EngineHealth(ready=True, message="", decode_path=self.decode_path.describe(),
                                    weight_version=self._weights.version, speculative=self.speculative)
        return True

    def _main(self) -> None:
        with native.stepping():  # this thread's kernel calls may run on every thread, other threads' on one
            self._step_loop()

    def _step_loop(self) -> None:
        if not self.prepare():
            return
        assert self.batcher is not None
        try:
            while not self._stop.is_set():
                try:
                    if self._cut_at is not None and time.monotonic() >= self._cut_at:
                        self._cut_at = None  # the drain's time is up: what still runs ends with a 503
                        self._fail_running(SHUTTING_DOWN)
                        for state in self.scheduler.drain():  # preempted ones, requeued meanwhile
                            self._fail(state, SHUTTING_DOWN)
                    self._adopt_decode_path()
                    if not self._may_step():
                        self.scheduler.wait(timeout=0.05)
                        continue
                    self._step_started = time.monotonic()
                    progress = self._progress()
                    self._failures.step_started()
                    stepped = self.batcher.step()
                    self._step_started = None
                    if stepped:
                        self._trimmer.worked()
                        self._failures.step_ended(self._progress() > progress)
                    else:
                        self._trimmer.poll()
                        self.scheduler.wait(timeout=0.05)
                except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the loop
                    self._step_started = None
                    log.exception("engine step failed")
                    self._failures.step_ended(False, f"{type(exc).__name__}: {exc}")
                    self._fail_running(f"internal error: {exc}")
        except BaseException as exc:  # the loop itself died: say so, and never leave a client waiting
            log.exception("engine thread stopped")
            self._died(f"the engine stopped: {exc!r}")
            return
        self.batcher.abort_all()

    def _adopt_decode_path(self) -> None:
        """Between two steps: take the decode path a background compile has just settled."""
        steps = self.runner.decode_steps if self.runner is not None else None
        path = steps.poll() if steps is not None else None
        if path is not None:
            self.decode_path = path
            self._info.decode_path = path.describe()
            self._health = dataclasses.replace(self._health, decode_path=path.describe())
            log.warning("decode path: %s", path.describe())

    def _died(self, message: str) -> None:
        """The step loop is gone: health turns 503, new requests are refused, live ones fail."""
        with self._lock:
            self._accepting = False
            self._health = EngineHealth(ready=False, message=message)
            live = list(self._live.values())
        for state in live:
            self._fail(state, message)

    def _fail_running(self, message: EngineError | str) -> None:
        """Fail every request in the batch and the prefill (their KV state is unknown after a failed
        decode step; a failed prefill is handled by the batcher and fails its group only)."""
        assert self.batcher is not None
        for state in self.batcher.clear():
            self._fail(state, message)

    def _progress(self) -> int:
        """Tokens the steps have computed so far (prompt and generated)."""
        return self._counters["prompt_tokens"] + self._counters["generation_tokens"]

    def _fail(self, state: RequestState, error: EngineError | str) -> None:
        """End ``state`` in-band with ``error`` (a message: a 500 engine error); no-op once closed."""
        if state.closed:
            return
        state.closed = True
        error = error if isinstance(error, EngineError) else EngineError(error)
        self._failures.request_failed(error.type, error.message)
        state.stream.put(state.fail(error))
        state.stream.finish()
        self._forget(state, "requests_failed")

    def _load(self) -> None:
        loaded = load_runner(self.engine_config, self._info.max_model_len, self.device, self.quantization, self.capture,
                             PREFILL_CHUNK_TOKENS)  # fmt: skip
        self.cache_plan, self.decode_path = loaded.plan, loaded.decode_path
        self.speculative = loaded.speculative
        if not loaded.speculates:
            self.drafter = None
        elif self.drafter is not None and self.drafter.config.method == "draft_model":
            self.drafter.draft = DraftModel.load(self.drafter.config.model, self.model_path, self.device,
                                                 self.engine_config.cache_dir)  # fmt: skip
        self._info.decode_path = self.decode_path.describe()
        self.scheduler.pool = loaded.pool
        self.runner = loaded.runner
        self._make_lora(loaded.runner)


__all__ = ["OutputKind", "OutputStream", "TransformersEngine"]
