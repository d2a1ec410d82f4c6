"""The model runner: one flat forward per step over the paged KV cache; knows no requests or text.

A step is a list of :class:`Work` items — for each scheduled sequence, the tokens to feed, the
position of the first one, the sequence's block table, and which logits it needs. The runner lays
them side by side in one ``[1, T]`` forward (prefill chunks and decode tokens share it: vLLM's
chunked prefill), writes their KV into the slots their block tables name and returns the wanted
logits in fp32. Steps made only of single-token items go through :class:`DecodeSteps`, which
pads them to a fixed bucket and (on CUDA) replays a captured graph.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch

from gyrfalcon.engine.kv.cache import PagedKVCache
from gyrfalcon.engine.kv.table import BlockTable
from gyrfalcon.engine.model import flex, layer_loop, one_query, staging
from gyrfalcon.engine.model.attention import STEP_KWARG, Segment, StepMetadata, register
from gyrfalcon.engine.model.captured import DecodeSteps
from gyrfalcon.engine.model.fast_check import FAST_STEP_RTOL, check_fast_step
from gyrfalcon.engine.model.decoder import DirectDecoder, unsupported
from gyrfalcon.engine.model.heads import StepHeads
from gyrfalcon.engine.lora.step import LoraRows
from gyrfalcon.engine.model.work import Work, kept_rows, riding, slots_of
from gyrfalcon.kernels.quant.apply import coarsest, matmul_inputs

log = logging.getLogger(__name__)


class ModelRunner:
    """Runs steps of a transformers causal LM over a :class:`PagedKVCache`.

    ``capture``: ``"cuda-graphs"`` replays captured decode steps (CUDA only), ``"compiled"`` runs
    small decode batches through ``torch.compile`` (CPU), ``"static"`` runs decode steps through the
    same static, bucket-padded buffers eagerly (what a fast step computes, on any device — the tests
    use it on the CPU), ``"off"`` runs every step as it is. A fast path serves only once
    ``decode_steps.prepare()`` has checked it against the eager step
    (:mod:`gyrfalcon.engine.model.captured`).

    ``model_impl`` (vLLM's ``--model-impl``): ``auto`` runs the model through
    :class:`~gyrfalcon.engine.model.decoder.DirectDecoder` where its architecture has one, else
    through transformers; ``direct`` refuses a model without one; ``transformers`` always runs
    transformers' forward. :meth:`check_direct` proves the direct forward against transformers'.

    ``attention`` (``--attention-backend``): ``gather`` copies each sequence's blocks and runs SDPA,
    ``flex`` reads the blocks in place (:mod:`~gyrfalcon.engine.model.flex`), ``auto`` is flex on
    CUDA and gather elsewhere; :meth:`check_attention` proves flex against gather.

    ``kernels``: the folder the C kernels are built in; ``verdicts``: the one the compiled step's
    refusals are kept in between starts (:mod:`~gyrfalcon.engine.model.verdicts`).
    """

    def __init__(self, model, cache: PagedKVCache, capture: str = "off", max_batch: int = 1, max_model_len: int = 2048,
                 model_impl: str = "auto", attention: str = "gather", kernels: Path | None = None,
                 verdicts: Path | None = None) -> None:  # fmt: skip
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.forwards = 0  # model calls so far (tests count forwards through this)
        name = register()
        for config in (model.config, getattr(model.config, "text_config", None)):
            if config is not None:
                config._attn_implementation = name
        self.direct: DirectDecoder | None = None
        #: which forward runs, and why (the start-up line)
        self.model_impl = "transformers (--model-impl transformers)"
        if model_impl != "transformers":
            reason = unsupported(model)
            if reason is not None and model_impl == "direct":
                raise ValueError(f"--model-impl direct: {reason}")
            self.direct = DirectDecoder(model, max_model_len, kernels) if reason is None else None
            fused = "q/k/v and gate/up fused; " if self.direct is not None and self.direct.fused else ""
            self.model_impl = f"direct ({fused}norms sum by {self.direct.norms})" if self.direct else f"transformers ({reason})"
        #: the attention backend steps use: ``gather`` or ``flex``
        self.attention = flex.resolve(attention, self.device)
        shape = cache.shape
        #: whether single-query rows read the blocks in place (``one_query_attention.c``): fixed for
        #: the model and its cache, decided here once (after the direct forward loaded the kernels)
        self.rows_in_place = one_query.applies(self.device, model.dtype, shape.dtype,
                                               getattr(model.config, "num_attention_heads", shape.num_kv_heads),
                                               shape.num_kv_heads, shape.head_dim)  # fmt: skip
        #: every running sequence's blocks, kept on the device between steps
        self.block_table = BlockTable(-(-max_model_len // cache.block_size), self.device)
        #: the LoRA adapters' registry (``--enable-lora``; set before the decode path is prepared):
        #: a static decode step's rows read their slots' factors from it
        self.lora_registry: Any = None
        self.decode_steps = None
        if capture != "off":
            self.decode_steps = DecodeSteps(self, max_batch, max_model_len, mode=capture, verdicts=verdicts)

    @property
    def logits_width(self) -> int:
        """The width of the logits rows (the output embedding's rows; may exceed the tokenizer's
        vocabulary where a model pads it)."""
        head = self.model.get_output_embeddings()
        if head is None:
            return int(self.model.config.vocab_size)
        return int(getattr(head, "out_features", None) or head.weight.shape[0])

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepMetadata, keep) -> torch.Tensor:
        """One model call: ``[1, T]`` ids and positions; the kept positions' logits ``[K, V]``."""
        if self.direct is not None:
            return self.direct(input_ids, positions, step, keep)
        return self.transformers_forward(input_ids, positions, step, keep)

    def transformers_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepMetadata,
                             keep) -> torch.Tensor:  # fmt: skip
        """:meth:`run_model` through transformers' modelling code, whatever ``model_impl`` says."""
        out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=keep,
                         **{STEP_KWARG: step})  # fmt: skip
        return out.logits[0]

    @contextlib.contextmanager
    def _set(self, **values):
        """Set attributes for the time of a ``with`` block."""
        before = {name: getattr(self, name) for name in values}
        for name, value in values.items():
            setattr(self, name, value)
        try:
            yield
        finally:
            for name, value in before.items():
                setattr(self, name, value)

    def eager(self):
        """A ``with`` block whose steps all run eagerly (no decode bucket)."""
        return self._set(decode_steps=None)

    def use_cache(self, cache: PagedKVCache) -> None:
        """Serve from ``cache`` from now on: the real cache, after the provisional one the step
        budget was measured on (:mod:`~gyrfalcon.engine.model.budget`); before any decode bucket
        is made (a bucket holds the cache it was made with)."""
        if cache.shape != self.cache.shape or cache.device != self.cache.device or cache.block_size != self.cache.block_size:
            raise ValueError("the runner's cache can only be replaced by one of the same shape, blocks and device")
        if self.decode_steps is not None and self.decode_steps.made:
            raise ValueError("the runner's cache cannot be replaced once decode buckets are made on it")
        self.cache = cache

    def _agree(self, steps: list[list[Work]], other: dict, names: tuple[str, str]) -> str | None:
        """Run each step of ``steps`` as the runner is set, then with the attributes ``other`` (the
        same KV slots are written twice; both eagerly: a captured bucket would replay one of the
        two): None when every step gives the same argmax and logits within the dtype's tolerance,
        else why not."""
        # two forwards' rows drift apart by the coarsest rounding on their way: the matmuls' inputs,
        # or a KV cache coarser than the stream (a chunk's own keys read fresh by one, from the cache by the other)
        rtol = FAST_STEP_RTOL.get(coarsest(matmul_inputs(self.model), self.cache.shape.dtype), 1e-4)
        with self.eager():
            for works in steps:
                def this_step(works=works):
                    return self.forward(works)[0]

                def other_step(works=works):
                    with self._set(**other):
                        return self.forward(works)[0]

                problem = check_fast_step(this_step, other_step, rtol, names=names)
                if problem is not None:
                    return problem
        return None

    @torch.inference_mode()
    def check_attention(self, steps: list[list[Work]], required: bool = False) -> str:
        """With ``flex`` attention, run each step of ``steps`` (the warm-up) through flex and through
        gather; keep flex only if they agree (as :meth:`check_direct`). Returns the backend that
        serves, and why; ``required`` (``--attention-backend flex``) makes a disagreement a ``ValueError``."""
        if self.attention != "flex":
            if self.rows_in_place:
                return f"{self.attention} (single-query rows read the blocks in place: one_query_attention.c)"
            return self.attention
        problem = self._agree(steps, {"attention": "gather"}, names=("flex attention", "gather one"))
        if problem is None:
            return "flex (the KV blocks read in place)"
        if required:
            raise ValueError(f"--attention-backend flex: {problem}")
        self.attention = "gather"
        return f"gather ({problem})"

    @torch.inference_mode()
    def check_layer_loop(self, scratch: list[int]) -> str:
        """Serve steps of decode rows only through :class:`~gyrfalcon.engine.model.layer_loop.LayerLoop`
        if the direct forward's layers allow it and it gives their operators' bits — to the last
        one, as a compiled step must (a request's rows take it alone and the operators beside a
        prefill) — on decode steps of 1 to 8 rows over the ``scratch`` block (prefilled first).
        Returns which runs decode rows' layers, and why."""
        if self.direct is None:
            return "operators (transformers' forward)"
        reason = layer_loop.unsupported(self.direct, self.cache, self.rows_in_place and self.attention == "gather")
        if reason is not None:
            return f"operators ({reason})"
        loop = layer_loop.LayerLoop(self.direct)
        width = self.cache.block_size
        steps = [[Work([5 + t for t in range(width // 2)], 0, scratch, "none")], [Work([7], width // 2, scratch)],
                 [Work([8 + r], (3 * r + 1) % width, scratch) for r in range(5)],
                 [Work([9 + r], (5 * r + 2) % width, scratch) for r in range(8)]]  # fmt: skip

        def looped(works: list[Work]) -> torch.Tensor:
            self.direct.layer_loop = loop
            try:
                return self.forward(works)[0]
            finally:
                self.direct.layer_loop = None

        with self.eager():
            self.forward(steps[0])
            for works in steps[1:]:
                problem = check_fast_step(lambda works=works: looped(works), lambda works=works: self.forward(works)[0],
                                          0.0, names=("layer loop", "operators' step"))  # fmt: skip
                if problem is not None:
                    return f"operators ({problem})"
        self.direct.layer_loop = loop
        return loop.describe()

    @torch.inference_mode()
    def rows_alike(self, scratch: list[int]) -> str | None:
        """None when a decode row's logits are the same bits alone as beside further rows of its
        sequence (what speculation's draft rows need: :mod:`gyrfalcon.engine.spec.drafter`), else
        why not; on the ``scratch`` block, eagerly (every fast decode path gives the eager bits)."""
        width = self.cache.block_size
        at = width // 2
        with self.eager():
            self.forward([Work([5 + t for t in range(at)], 0, scratch, "none")])
            alone = self.forward([Work([7], at, scratch)])[0]
            beside = self.forward([Work([7], at, scratch), Work([8], at + 1, scratch), Work([9], at + 2, scratch)])[0]
        if torch.equal(alone[0], beside[0]):
            return None
        delta = float((alone[0] - beside[0]).abs().max())
        return f"a decode row's logits differ beside other rows (max |Δ| {delta:.2g}: these layers' kernels are not row-invariant)"

    @torch.inference_mode()
    def check_direct(self, steps: list[list[Work]], required: bool = False) -> str:
        """Run each step of ``steps`` (the warm-up) through the direct forward and through transformers' (same
        inputs: the same KV slots are written twice); keep the direct forward only if every step
        gives the same argmax and logits within the dtype's tolerance. Returns :attr:`model_impl`;
        ``required`` (``--model-impl direct``) turns a disagreement into a ``ValueError``."""
        if self.direct is None:
            with self.eager():
                for works in steps:
                    self.forward(works)
            return self.model_impl
        problem = self._agree(steps, {"direct": None}, names=("direct forward", "transformers one"))
        if problem is not None:
            if required:
                raise ValueError(f"--model-impl direct: {problem}")
            self.direct, self.model_impl = None, f"transformers ({problem})"
        return self.model_impl

    def forward(self, works: list[Work]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Run one step; returns fp32 logits and, per work item, its ``(first row, row count)``
        (:meth:`step` without the reductions; the logits are the caller's to keep)."""
        heads, spans = self.step(works)
        return heads.kept_logits(), spans

    @torch.inference_mode()
    def step(self, works: list[Work]) -> tuple[StepHeads, list[tuple[int, int]]]:
        """Run one step; returns its fp32 logits (with their reductions where the step computed
        them: :mod:`~gyrfalcon.engine.model.heads`; ``shared``: valid until the next step) and, per work item,
        its ``(first row, row count)``. The values of a :class:`~gyrfalcon.engine.model.work.StepWorks`'s
        rider (the sampler's rows, the draw rows) go to the device in the same copy as the step's inputs."""
        self.forwards += 1
        self.block_table.settle()  # the rows of the last step's work built by hand
        if self.decode_steps is not None and all(len(w.tokens) == 1 and w.logits == "last" for w in works):
            heads = self.decode_steps.run(works)
            if heads is not None:
                return heads, [(i, 1) for i in range(len(works))]
        bs = self.cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        spans: list[tuple[int, int]] = []
        decode: list[tuple[int, Work]] = []
        prefill: list[tuple[int, Work]] = []
        for work in works:
            offset, count = len(ids), len(work.tokens)
            ids.extend(work.tokens)
            positions.extend(range(work.start, work.start + count))
            slots.extend(slots_of(work.blocks, work.start, work.start + count, bs))
            (decode if count == 1 else prefill).append((offset, work))
            rows = [offset + row for row in kept_rows(work)]
            spans.append((len(keep), len(rows)))
            keep.extend(rows)
        # every input of the forward in one host-to-device copy, then views of it; the block tables
        # are rows of the persistent table, of which only the new entries travel
        table = self.block_table
        decode_rows = [table.place(w.owner, w.blocks) for _, w in decode]
        prefill_rows = [table.place(w.owner, w.blocks) for _, w in prefill]
        parts = [ids, positions, slots, keep, [o for o, _ in decode], [w.start for _, w in decode], decode_rows]
        views = staging.send_step(parts, table, riding(works), self.device)
        step = StepMetadata(self.cache, views[2], attention=self.attention, rows_in_place=self.rows_in_place)
        if any(getattr(w.owner, "lora", None) is not None for w in works):  # (--enable-lora, an adapter's rows)
            step.lora = LoraRows.of([(w.owner.lora if w.owner else None, o, len(w.tokens)) for o, w in [*decode, *prefill]],
                                    self.device)  # fmt: skip
        if decode:
            step.decode_rows, step.decode_positions = views[4], views[5]
            step.decode_blocks = table.rows(views[6], -(-max(w.start + 1 for _, w in decode) // bs))
        for (offset, work), row in zip(prefill, prefill_rows):
            blocks = -(-(work.start + len(work.tokens)) // bs)
            step.prefills.append(Segment(offset, work.start, len(work.tokens), table.tensor[row, :blocks]))
        logits = self.run_model(views[0].unsqueeze(0), views[1].unsqueeze(0), step, views[3])
        return StepHeads(logits.float()), spans
