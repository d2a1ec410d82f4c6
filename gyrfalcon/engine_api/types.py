"""Plain-data types that cross the engine boundary.

Everything here is a dataclass of built-in values (no tensors, no open handles, no callbacks), so
that a request and its outputs can be pickled or sent as JSON to an engine in another process.
Field names follow vLLM's ``SamplingParams`` and ``RequestOutput`` so that a delegating engine is a
thin adapter.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

#: Temperatures below this are greedy decoding (vLLM's threshold), in the spec and the code alike.
GREEDY_TEMPERATURE = 1e-5

#: Logprob values are always finite on the wire; ``-inf`` becomes this value.
LOGPROB_FLOOR = -9999.0

#: Seeds are int64 on the wire; child seeds ``seed + index`` wrap modulo 2**64.
SEED_MODULUS = 2**64


class OutputKind(str, enum.Enum):
    """How a request's output stream reports progress.

    ``DELTA``: each output carries only what is new since the previous one (streaming).
    ``CUMULATIVE``: each output carries everything produced so far.
    ``FINAL_ONLY``: one output, when every choice has finished (non-streaming).
    """

    DELTA = "delta"
    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    """Sampling parameters with vLLM's names and defaults.

    A field left at its default is "not asked for"; the frontend rejects a non-default field the
    engine does not list in :attr:`EngineInfo.capabilities`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    #: number of top log-probabilities per generated position (None: no logprobs at all)
    logprobs: int | None = None
    #: number of top log-probabilities per prompt position (None: none)
    prompt_logprobs: int | None = None
    #: explicit token ids whose logprobs are reported at every generated position
    logprob_token_ids: list[int] | None = None
    #: False: the output carries token ids only, no text (the client side skips detokenisation;
    #: stop strings need text, so they are refused with it, as in vLLM)
    detokenize: bool = True
    #: a constraint on the generated text, vLLM's ``StructuredOutputsParams`` as plain data: exactly
    #: one of ``json`` (a JSON schema object), ``json_object`` (true: any JSON object), ``regex``,
    #: ``choice`` (a list of strings), ``grammar`` (Lark or GBNF text) or ``structural_tag`` (JSON
    #: text); None: unconstrained. The structured-output plugin honours it.
    structured_outputs: dict[str, Any] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def child_seed(self, index: int) -> int | None:
        """The seed of choice ``index``: ``seed + index`` modulo 2**64 (None when unseeded)."""
        if self.seed is None:
            return None
        return (self.seed + index) % SEED_MODULUS

    def asked_fields(self) -> set[str]:
        """Names of the fields set to something other than their default."""
        asked = set()
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if getattr(self, f.name) != default:
                asked.add(f.name)
        return asked


@dataclass
class EngineRequest:
    """One request as the engine sees it: prompt token ids, sampling parameters, output kind.

    ``extensions`` holds plugin-declared fields (already validated by the frontend) by name.
    ``cache_salt`` isolates the request's prefix-cache entries: only requests with the same salt
    share cached prompt blocks. ``priority``: lower runs earlier under the engine's ``priority``
    scheduling policy (vLLM's rule); only 0 is accepted otherwise. ``group_id``: the id of what a
    client sent, shared by the engine requests it made (one per prompt): what
    :meth:`~gyrfalcon.engine_api.interface.EngineCore.abort_requests` names.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    output_kind: OutputKind = OutputKind.FINAL_ONLY
    extensions: dict[str, Any] = field(default_factory=dict)
    cache_salt: str | None = None
    priority: int = 0
    group_id: str | None = None
    #: the LoRA adapter the request runs with (its name; None: the base model)
    lora_name: str | None = None


@dataclass
class TokenLogprobs:
    """Log-probabilities at generated (or prompt) positions, as parallel lists.

    For position ``i``: ``token_ids[i]`` is the token at that position and ``logprobs[i]`` its
    logprob; ``top_token_ids[i]`` / ``top_logprobs[i]`` list the other reported tokens (the top-k,
    then any explicitly requested ids), without the position's own token unless it ranks there.
    A prompt position without a logprob (the first one) holds ``None`` in ``logprobs``.

    ``ranks`` / ``top_ranks``, when the engine computed them (prompt positions), are parallel to
    ``token_ids`` / ``top_token_ids`` (vLLM's rule): the position's own token's rank is the number
    of vocabulary tokens at least as likely as it; a listed token's is its place in the list (1: the
    most likely). Empty when not computed.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    top_ranks: list[list[int]] = field(default_factory=list)

    def extend(self, other: TokenLogprobs) -> None:
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.top_token_ids.extend(other.top_token_ids)
        self.top_logprobs.extend(other.top_logprobs)
        self.ranks.extend(other.ranks)
        self.top_ranks.extend(other.top_ranks)

    def since(self, start: int) -> TokenLogprobs:
        """The positions from ``start`` on, in lists of their own."""
        return TokenLogprobs(
            self.token_ids[start:],
            self.logprobs[start:],
            [list(x) for x in self.top_token_ids[start:]],
            [list(x) for x in self.top_logprobs[start:]],
            self.ranks[start:],
            [list(x) for x in self.top_ranks[start:]],
        )

    def rank(self, position: int, token_id: int) -> int | None:
        """The rank of ``token_id`` (the position's own token or one it lists), None when unknown."""
        if position >= len(self.ranks):
            return None
        if token_id == self.token_ids[position]:
            return self.ranks[position]
        for listed, rank in zip(self.top_token_ids[position], self.top_ranks[position]):
            if listed == token_id:
                return rank
        return None


@dataclass
class CompletionOutput:
    """One choice of a request.

    In a DELTA output ``text``/``token_ids``/``logprobs`` hold only what is new; in CUMULATIVE and
    FINAL_ONLY outputs they hold everything so far. ``finish_reason`` is ``"stop"``, ``"length"``
    or ``"abort"`` once the choice has finished, else None. ``stop_reason`` is the stop string or
    stop token id that ended it (None for end-of-sequence or length). ``weight_versions``, on the
    output that finishes the choice: which weights made which of its tokens, as ``[version, first
    token index]`` pairs in order (more than one when the weights were replaced while it ran).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    weight_versions: list[list[Any]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineError:
    """An error reported in-band on an output stream (the request ends with it).

    ``type`` is its kind: ``invalid_request_error`` (the request cannot be served as asked, naming
    its ``param``), ``server_shutting_down`` or ``server_overloaded`` (a retry may succeed), anything
    else a failure of the server. The engine speaks no HTTP: :func:`gyrfalcon.api.errors.http_status`
    alone turns a kind into a status.
    """

    message: str
    type: str = "engine_error"
    param: str | None = None
    #: seconds after which a retry may succeed (a 503's ``Retry-After``); None: no such header
    retry_after: float | None = None


@dataclass
class RequestOutput:
    """One item of a request's output stream.

    ``outputs`` lists the choices that changed (DELTA) or all choices (CUMULATIVE, FINAL_ONLY).
    ``finished`` is True on the last item; ``num_generated_tokens`` counts every choice's tokens
    so far, for usage.
    """

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: TokenLogprobs | None = None
    num_generated_tokens: int = 0
    error: EngineError | None = None
    #: on the first output after its first step: seconds the request waited in the engine's queue
    queue_time: float | None = None


@dataclass
class EngineInfo:
    """What an engine serves and can honour.

    ``capabilities`` names every ``SamplingParams`` field the engine honours (plus ``extensions``
    names); the frontend rejects any other field set to a non-default value with a 400.
    """

    model_path: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    max_logprobs: int
    max_num_seqs: int
    capabilities: frozenset[str]
    dtype: str = "float32"
    device: str = "cpu"
    #: the weight kernels the linear layers run in (``--quantization`` resolved: none, int4, int8)
    quantization: str = "none"
    #: most sequences (choices) one request may have; those beyond ``max_num_seqs`` wait their turn
    max_request_seqs: int = 1024
    #: the model's sampling defaults for fields a client leaves unset (``temperature``, ``top_p``,
    #: ``top_k``, ``min_p``, ``repetition_penalty``; ``max_tokens`` caps the unset default), from
    #: its generation config (vLLM's ``--generation-config auto``); empty with ``none``
    default_sampling: dict[str, Any] = field(default_factory=dict)
    #: which path decode steps take and why (``captured (…)``, ``compiled (…)``, ``eager (…)``), as
    #: :class:`EngineHealth` says it; None until the model is loaded and its fast path checked
    decode_path: str | None = None
    #: what the logprobs it returns hold (``engine_api.config.LOGPROBS_MODES``)
    logprobs_mode: str = "raw_logprobs"


#: how :meth:`~gyrfalcon.engine_api.interface.EngineCore.pause` treats what runs (vLLM's modes)
PAUSE_MODES: dict[str, str] = {
    "abort": "what was submitted before the pause ends at once, its choices with finish_reason abort",
    "wait": "what was submitted before the pause runs to its end",
    "keep": "what was submitted before the pause stays where it is and continues after the resume",
}


@dataclass
class PauseState:
    """Whether generation is paused (``mode``: one of :data:`PAUSE_MODES`, None when it runs),
    whether the pause has taken full effect (``settled``: nothing submitted before it runs any more,
    or with ``keep`` the step loop has stopped), and how many requests submitted since wait for the
    resume (``held``)."""

    mode: str | None = None
    settled: bool = False
    held: int = 0


#: what a sleep of each level hands back to the system (vLLM's levels), by the tags
#: :meth:`~gyrfalcon.engine_api.interface.EngineCore.wake_up` takes them back with
SLEEP_LEVELS: dict[int, tuple[str, ...]] = {1: ("kv_cache",), 2: ("kv_cache", "weights")}
WAKE_TAGS = ("kv_cache", "weights")


@dataclass
class SleepState:
    """Whether the engine sleeps: the ``level`` the last sleep asked for (0: awake, every part
    back), the parts whose memory is handed back now (``asleep``: of :data:`WAKE_TAGS`), and
    whether the sleep has taken effect (``settled``: False while it waits for what runs to end)."""

    level: int = 0
    asleep: tuple[str, ...] = ()
    settled: bool = True


@dataclass
class EngineHealth:
    """``ready`` is False while the model loads or warms up; ``message`` says why. ``decode_path``:
    which path decode steps take and why (``compiled (…)``, ``captured (…)``, ``eager (…)``), once known."""

    ready: bool
    message: str = ""
    decode_path: str = ""
    #: the version of the weights being served (``engine.weights.FIRST_VERSION`` until an update)
    weight_version: str = ""
    #: speculative decoding as it serves, or why not (``--speculative-config``); "" when not asked
    speculative: str = ""
