"""The engine boundary's types as msgpack: positional lists, one encoder and decoder per type
(the engine process and its API workers, and Ray's replicas and their callers, speak it).

Positional lists (not dicts) keep a step's outputs small and fast to pack; the field order is that
of the dataclasses in :mod:`gyrfalcon.engine_api.types`, and both ends always run the same code
(one installation starts both processes), so no version field is carried.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from gyrfalcon.engine_api.errors import EngineUnavailable, QueueFull, ShuttingDown
from gyrfalcon.engine_api.types import (
    CompletionOutput,
    EngineError,
    EngineHealth,
    EngineInfo,
    EngineRequest,
    OutputKind,
    PauseState,
    SleepState,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)
from gyrfalcon.errors import RequestError

_SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
_UNAVAILABLE = {cls.__name__: cls for cls in (EngineUnavailable, QueueFull, ShuttingDown)}


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack(data: bytes) -> Any:
    # logit_bias maps token ids (ints) to floats: int map keys must be allowed
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ---------------------------------------------------------------- requests


def encode_request(request: EngineRequest) -> list[Any]:
    sampling = request.sampling
    return [request.request_id, request.prompt_token_ids, [getattr(sampling, name) for name in _SAMPLING_FIELDS],
            request.output_kind.value, request.extensions, request.cache_salt, request.priority,
            request.group_id, request.lora_name]  # fmt: skip


def decode_request(data: list[Any], request_id: str | None = None) -> EngineRequest:
    """The request of :func:`encode_request`; ``request_id`` replaces its id (the engine's prefix)."""
    rid, prompt, sampling, kind, extensions, salt, priority, group, lora = data
    return EngineRequest(request_id if request_id is not None else rid, prompt,
                         SamplingParams(**dict(zip(_SAMPLING_FIELDS, sampling))), OutputKind(kind), extensions,
                         salt, priority, group, lora)  # fmt: skip


# ---------------------------------------------------------------- outputs


def _encode_logprobs(lp: TokenLogprobs | None) -> list[Any] | None:
    if lp is None:
        return None
    return [lp.token_ids, lp.logprobs, lp.top_token_ids, lp.top_logprobs, lp.ranks, lp.top_ranks]


def _decode_logprobs(data: list[Any] | None) -> TokenLogprobs | None:
    return None if data is None else TokenLogprobs(*data)


def encode_error(error: EngineError | None) -> list[Any] | None:
    if error is None:
        return None
    return [error.message, error.type, error.param, error.retry_after]


def decode_error(data: list[Any] | None) -> EngineError | None:
    return None if data is None else EngineError(*data)


def encode_output(output: RequestOutput) -> list[Any]:
    choices = [[c.index, c.text, c.token_ids, _encode_logprobs(c.logprobs), c.finish_reason, c.stop_reason,
                c.weight_versions] for c in output.outputs]  # fmt: skip
    return [choices, output.finished, output.prompt_token_ids, _encode_logprobs(output.prompt_logprobs),
            output.num_generated_tokens, encode_error(output.error), output.queue_time]  # fmt: skip


def decode_output(request_id: str, data: list[Any]) -> RequestOutput:
    choices, finished, prompt_ids, prompt_lp, generated, error, queue_time = data
    outputs = [CompletionOutput(index, text, ids, _decode_logprobs(lp), finish, stop, versions)
               for index, text, ids, lp, finish, stop, versions in choices]  # fmt: skip
    return RequestOutput(request_id, outputs, finished, prompt_ids, _decode_logprobs(prompt_lp), generated,
                         decode_error(error), queue_time)  # fmt: skip


# ---------------------------------------------------------------- info, health, refusals


def encode_info(info: EngineInfo) -> dict[str, Any]:
    return {**dataclasses.asdict(info), "capabilities": sorted(info.capabilities)}


def decode_info(data: dict[str, Any]) -> EngineInfo:
    return EngineInfo(**{**data, "capabilities": frozenset(data["capabilities"])})


def encode_health(health: EngineHealth) -> list[Any]:
    return [health.ready, health.message, health.decode_path, health.weight_version, health.speculative]


def decode_health(data: list[Any]) -> EngineHealth:
    return EngineHealth(*data)


#: the core's methods an API worker calls by name (``call`` messages); their results travel as
#: :func:`encode_result` makes them
CORE_CALLS = frozenset({"stats", "pause", "resume", "pause_state", "abort_requests", "update_weights", "sleep",
                        "wake_up", "sleep_state", "load_lora_adapter", "unload_lora_adapter", "lora_adapters"})  # fmt: skip


def encode_result(value: Any) -> Any:
    """A core call's result as msgpack carries it (a :class:`PauseState` or :class:`SleepState` as a list)."""
    if isinstance(value, PauseState):
        return [value.mode, value.settled, value.held]
    if isinstance(value, SleepState):
        return [value.level, list(value.asleep), value.settled]
    return value


def decode_pause(data: list[Any]) -> PauseState:
    return PauseState(*data)


def decode_sleep(data: list[Any]) -> SleepState:
    return SleepState(data[0], tuple(data[1]), data[2])


def encode_refusal(exc: BaseException) -> list[Any]:
    """What ``submit`` raised, for :func:`raise_refusal` on the other side."""
    if isinstance(exc, RequestError):
        return ["request", exc.message, exc.param, exc.type, exc.retry_after]
    if isinstance(exc, EngineUnavailable):
        name = type(exc).__name__ if type(exc).__name__ in _UNAVAILABLE else EngineUnavailable.__name__
        return ["unavailable", name, exc.message, exc.retry_after]
    return ["internal", f"{type(exc).__name__}: {exc}"]


#: the one key of a control call's answer that carries a refusal (:func:`encode_refusal`) instead of
#: a result: Ray replicas answer refusals so (what a Ray call raises reaches the caller wrapped, its
#: kind and param lost)
REFUSED = "refused"


def raise_refusal(data: list[Any]) -> None:
    kind = data[0]
    if kind == "request":
        _, message, param, type_, retry_after = data
        raise RequestError(message, param, type=type_, retry_after=retry_after)
    if kind == "unavailable":
        _, name, message, retry_after = data
        raise _UNAVAILABLE[name](message, retry_after)
    raise RuntimeError(f"the engine failed to take the request: {data[1]}")
