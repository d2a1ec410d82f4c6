"""The structured-output logits processor: one llguidance matcher per row, one batched mask per step.

A constraint is compiled at submit (off the step loop: a large schema takes tens of ms) and
cached by a hash of its text, within a byte budget; a row's matcher is a copy of it, made when its
sequence joins the persistent batch and catches up with the tokens the sequence drew since
the last step. Each step, llguidance fills every constrained row's bitmask in one native call
(on its own threads), the mask goes to the device once, and the disallowed tokens' logits become
``-inf``: before penalties, temperature and truncation (the lowest ``order``), so those see only
tokens the constraint allows. Logprobs stay those of the raw distribution (vLLM's rule).

Overlap with the forward: nothing in the step waits for the device before the processors run (the
sampler reads only host lists until its one transfer at the end), so on a GPU the host-side fill
runs while the forward's kernels are still executing, and the mask joins the device queue behind
them. On the CPU the forward is synchronous and the fill follows it (measured by
``python -m gyrfalcon.bench.structured``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gyrfalcon.engine_api.types import EngineInfo, SamplingParams
from gyrfalcon.policies import BatchRows, LogitsProcessor, NewRow, put_rows, row_index, take_rows, to_device
from gyrfalcon.structured.grammar import DigestCache, check, constraint_key

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: bytes of compiled grammars kept (a request with a known constraint skips compilation), each
#: counted as :data:`MATCHER_BYTES_PER_GRAMMAR_BYTE` times its grammar's text
CACHE_BYTES = 64 << 20
#: what a compiled matcher holds per byte of grammar text, about (40 matchers of a 26 KB schema's
#: grammar took 15 MiB on the default model's tokenizer: 14 per byte)
MATCHER_BYTES_PER_GRAMMAR_BYTE = 16


def _cleared_bit(bit: int) -> int:
    """The int32 word with every bit set but ``bit`` (an AND mask for llguidance's bitmask words)."""
    word = ~(1 << bit) & 0xFFFFFFFF
    return word - (1 << 32) if word >= 1 << 31 else word


@dataclass
class _Row:
    matcher: Any
    consumed: int


class StructuredOutputProcessor(LogitsProcessor):
    """Masks each constrained row to the tokens its grammar allows next (see the module)."""

    name = "structured_outputs"
    fields = frozenset({"structured_outputs"})
    order = -100

    def __init__(self, info: EngineInfo) -> None:
        self.info = info
        self._tokenizer: Any = None  # llguidance's view of the served tokenizer, built on first use
        #: (matcher, bytes counted) by the constraint's text; submit (validate) compiles, the step loop copies
        self._compiled = DigestCache(lambda entry: entry[1], CACHE_BYTES, CACHE_BYTES // 8)
        self._lock = threading.Lock()  # llguidance's view of the tokenizer is built once
        self._rows: dict[int, _Row] = {}
        self._executor: Any = None
        self._shifts: torch.Tensor | None = None
        #: the bitmask word and AND mask of each end-of-text id (cleared for rows whose grammar cannot end yet)
        self._eos_bits = [(i // 32, _cleared_bit(i % 32)) for i in info.eos_token_ids if 0 <= i < info.vocab_size]

    # ------------------------------------------------------------------ compiling (cached)

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                from gyrfalcon.models.loading import load_tokenizer

                self._tokenizer = llguidance.hf.from_tokenizer(load_tokenizer(self.info.model_path),
                                                               eos_token=list(self.info.eos_token_ids))  # fmt: skip
            return self._tokenizer

    def compiled(self, constraint: dict[str, Any]) -> Any:
        """A fresh matcher for ``constraint`` (compiled once, then copied from the cache)."""
        return self._compiled.get(constraint_key(constraint), lambda _: self._compile(constraint))[0].deep_copy()

    def _compile(self, constraint: dict[str, Any]) -> tuple[Any, int]:
        import llguidance

        grammar = check(constraint)
        return llguidance.LLMatcher(self._llg_tokenizer(), grammar), MATCHER_BYTES_PER_GRAMMAR_BYTE * len(grammar)

    # ------------------------------------------------------------------ the policy

    def prepare(self, params: SamplingParams, extensions: dict[str, Any]) -> None:
        """Compile the constraint now, at submit: the step loop, which every running request waits
        on, then finds it compiled (:meth:`add_row`). Its syntax was checked before (the plugin's
        ``gyrfalcon_validate_request``): a compile that fails here is still a 400."""
        if params.structured_outputs is not None:
            self.compiled(params.structured_outputs)

    def wants(self, params: SamplingParams, extensions: dict[str, Any]) -> bool:
        return params.structured_outputs is not None

    def add_row(self, slot: int, row: NewRow) -> None:
        matcher = self.compiled(row.params.structured_outputs)
        if row.output_token_ids:  # a sequence that joins again (preempted) or a forked child
            matcher.consume_tokens(list(row.output_token_ids))
        self._rows[slot] = _Row(matcher, len(row.output_token_ids))

    def remove_row(self, slot: int) -> None:
        self._rows.pop(slot, None)

    def __call__(self, logits: torch.Tensor, rows: BatchRows, selected: list[int]) -> torch.Tensor:
        import llguidance
        import llguidance.torch as llgt
        import torch

        matchers, broken, unfinished = [], [], []
        for place, i in enumerate(selected):
            state = self._rows[rows.slot_list[i]]
            drawn = rows.output_token_ids[i]
            if len(drawn) > state.consumed:  # the tokens drawn since the last step
                state.matcher.consume_tokens(drawn[state.consumed:])
                state.consumed = len(drawn)
            if state.matcher.is_error():
                broken.append(place)
            elif not state.matcher.is_accepting():
                unfinished.append(place)
            matchers.append((state.matcher, place))
        vocab = logits.shape[-1]
        bitmask = llgt.allocate_token_bitmask(len(selected), self._llg_tokenizer().vocab_size)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llgt.fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        if unfinished:
            # where nothing the vocabulary spells continues the grammar (regex "H\x06" after "H" on
            # SmolLM2, which has no token for 0x06), llguidance allows end-of-text alone: a 200
            # answer outside the constraint. End-of-text only where the grammar may end (cleared in
            # the host's bitmask: no transfer of its own); a row left with nothing gets the 400
            for word, mask in self._eos_bits:
                bitmask[unfinished, word] &= mask
        allowed = self._unpack(bitmask.to(logits.device, non_blocking=True), vocab)
        if broken:
            # llguidance 1.9 allows the byte after one no token spells (SmolLM2 has none for 0xf1,
            # 0xf2): the matcher rejects that draw, and the row gets nothing, the sampler's 400,
            # rather than an end-of-text only and a 200 outside the constraint
            allowed[to_device(broken, allowed.device)] = False
        index = row_index(selected, logits)
        constrained = take_rows(logits, index).masked_fill(~allowed, float("-inf"))
        return put_rows(logits, index, constrained)

    def _unpack(self, bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
        """``[k, W]`` int32 words → ``[k, vocab]`` booleans (tokens past the tokenizer's: False)."""
        import torch

        if self._shifts is None or self._shifts.device != bitmask.device:
            self._shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        bits = ((bitmask.unsqueeze(-1) >> self._shifts) & 1).bool().flatten(1)
        if bits.shape[1] >= vocab:
            return bits[:, :vocab]
        return torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]), value=False)
