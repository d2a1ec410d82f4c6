"""The persistent batch: each live sequence's sampling state, kept on the device between steps.

A sequence takes a *slot* when it first draws a token (:meth:`PersistentBatch.join`) and gives it
back when its KV is released (:meth:`PersistentBatch.leave`: it finished, its request ended, or it
was preempted — a preempted sequence joins again, with the tokens it has, when it next draws).
Joining decides once which policies the row wants and tells each of them (``add_row``), writes the
row's seed and, where a processor counts generated tokens, its counts; leaving tells them again
(``remove_row``). A step then only looks rows up by slot: :meth:`PersistentBatch.stage` lists,
before the forward, what the rows need on the device (their slots and draw positions, the rows of
each policy that only some rows want, the ids ``min_tokens`` bans), which travels with the step's inputs in their one
host-to-device copy, and :meth:`PersistentBatch.rows` reads it back; no per-row tensors are rebuilt
from Python lists.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from gyrfalcon.engine.sample.min_tokens import banned_pairs
from gyrfalcon.engine.sample.noise import DrawGenerators, as_int64, draw_uniforms
from gyrfalcon.engine.request_state import Sequence
from gyrfalcon.engine.model.staging import Rider
from gyrfalcon.policies import BatchRows, LogitsProcessor, LogprobGatherer, NewRow, RowList, SlotTensor, to_device

log = logging.getLogger(__name__)

#: ``BatchRows.selected`` keys of the rows the sampler itself treats apart (besides policies' ids)
SAMPLING_ROWS = "sampling"
MIN_TOKENS_ROWS = "min_tokens"


@dataclass
class StagedRows:
    """A step's rows as :meth:`PersistentBatch.stage` saw them before the forward, and what of them
    rides to the device with the step's inputs."""

    sequences: list[Sequence]
    slot_list: list[int]
    selected: dict[Any, list[int]]
    rider: Rider
    #: how many sequences had left the batch when these rows were staged
    departures: int
    #: how many (row, token id) pairs ``min_tokens`` bans at this draw (they ride too)
    bans: int = 0

    def still(self, sequences: list[Sequence], departures: int) -> bool:
        """Whether the step draws for these very rows, each still in the slot it had when staged
        (none has left since: a request that ended during the step, or a retried forward, makes
        them differ)."""
        return (departures == self.departures and len(sequences) == len(self.sequences)
                and all(a is b for a, b in zip(sequences, self.sequences)))  # fmt: skip


class PersistentBatch:
    """Slots for the live sequences of the engine; see the module docstring.

    ``processors`` and ``gatherers`` are the engine's policies (generated-position gatherers only);
    ``vocab_size`` and ``device`` those of the logits; ``eos_token_ids`` the model's end-of-text
    ids, with which a step's ``min_tokens`` bans ride with its inputs (None: the sampler makes them).
    """

    def __init__(self, processors: list[LogitsProcessor], gatherers: list[LogprobGatherer],
                 vocab_size: int, device: torch.device | str, eos_token_ids: list[int] | None = None) -> None:  # fmt: skip
        self.policies: list[Any] = [*processors, *gatherers]
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._slot_of: dict[Sequence, int] = {}  # by identity: a sequence holds its slot until it leaves
        self._free: list[int] = []
        self._joined: list[list[Any]] = []  # slot -> the keys of ``selected`` it is listed under
        self._wanted: dict[Any, set[int]] = {}  # key -> slots
        self._seeds = SlotTensor((), "long", 0)
        self._counts = SlotTensor((vocab_size,), "int32", 0)
        self._counted: set[int] = set()
        self._departures = 0  # sequences that left: a staged row's slot may have been given again

    def __len__(self) -> int:
        return len(self._slot_of)

    def slot(self, seq: Sequence) -> int | None:
        """``seq``'s slot, None when it holds none."""
        return self._slot_of.get(seq)

    # ----------------------------------------------------------------- events

    def join(self, seq: Sequence, extensions: dict[str, Any]) -> int:
        """Give ``seq`` a slot (its own again if it holds one) and tell the policies it wants.

        All or nothing: when a policy's ``wants`` or ``add_row`` raises, the policies already told
        hear ``remove_row``, the slot goes back, and the exception propagates (the sampling of that
        request fails; no row is ever sampled half-joined)."""
        slot = self._slot_of.get(seq)
        if slot is not None:
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._joined)
            self._joined.append([])
        params = seq.params
        row = NewRow(params, extensions, seq.prompt_token_ids, list(seq.token_ids), self.vocab_size, self.device)
        told: list[Any] = []
        try:
            for policy in self.policies:
                if policy.wants(params, extensions):
                    policy.add_row(slot, row)
                    told.append(policy)
        except BaseException:
            self._tell_removed(told, slot)
            self._free.append(slot)
            raise
        keys: list[Any] = [id(policy) for policy in told]
        if not params.greedy:
            keys.append(SAMPLING_ROWS)
        if params.min_tokens > len(seq.token_ids):
            keys.append(MIN_TOKENS_ROWS)
        for key in keys:
            self._wanted.setdefault(key, set()).add(slot)
        self._joined[slot] = keys
        self._slot_of[seq] = slot
        self._seeds.put(slot, as_int64(seq.seed), self.device)
        if any(getattr(policy, "uses_output_counts", False) for policy in told):
            counted = self._counts.row(slot, self.device)
            counted.zero_()
            if seq.token_ids:
                ids = to_device(seq.token_ids, self.device)
                counted.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
            self._counted.add(slot)
        return slot

    def leave(self, seq: Sequence) -> None:
        """``seq`` gives its slot back (a no-op when it holds none). A policy whose ``remove_row``
        raises is logged; the slot is freed all the same."""
        slot = self._slot_of.pop(seq, None)
        if slot is None:
            return
        self._departures += 1
        keys = self._joined[slot]
        for key in keys:
            self._wanted[key].discard(slot)
        self._tell_removed([p for p in self.policies if id(p) in keys], slot)
        self._joined[slot] = []
        self._counted.discard(slot)
        self._free.append(slot)

    @staticmethod
    def _tell_removed(policies: list[Any], slot: int) -> None:
        for policy in policies:
            try:
                policy.remove_row(slot)
            except Exception:  # noqa: BLE001 - a plugin's fault must not leak the slot or stop the engine
                log.exception("%s.remove_row(%d) failed", type(policy).__name__, slot)

    # ----------------------------------------------------------------- a step's view

    def stage(self, sequences: list[Sequence], extensions: list[dict[str, Any]]) -> StagedRows:
        """What a step drawing one token for each of ``sequences`` will need on the device — each
        row's slot and draw position, the rows of every policy that only some rows want, and (given
        the end-of-text ids) the (row, id) pairs ``min_tokens`` bans at this draw —,
        joining those that hold no slot yet: its :class:`~gyrfalcon.engine.model.staging.Rider`
        travels with the step's inputs, and :meth:`rows` reads it back."""
        slot_list = [self.join(seq, ext) for seq, ext in zip(sequences, extensions)]
        positions = [len(seq.token_ids) for seq in sequences]
        selected: dict[Any, list[int]] = {}
        for key, wanted in self._wanted.items():
            if wanted:
                selected[key] = [i for i, slot in enumerate(slot_list) if slot in wanted]
        partial = [rows for rows in selected.values() if 0 < len(rows) < len(sequences)]
        values = [*slot_list, *positions, *(i for rows in partial for i in rows)]
        bans: tuple[list[int], list[int]] = ([], [])
        if self.eos_token_ids is not None and MIN_TOKENS_ROWS in selected:
            params = [seq.params for seq in sequences]
            bans = banned_pairs(params, positions, self.eos_token_ids, selected[MIN_TOKENS_ROWS])
            values += [*bans[0], *bans[1]]
        return StagedRows(list(sequences), slot_list, selected, Rider(values), self._departures, len(bans[0]))

    def rows(self, sequences: list[Sequence], extensions: list[dict[str, Any]],
             staged: StagedRows | None = None) -> BatchRows:  # fmt: skip
        """The :class:`BatchRows` of a step drawing one token for each of ``sequences`` (in order),
        joining those that hold no slot yet. With ``staged`` (:meth:`stage` of the same rows, its
        rider carried by the step) nothing more goes to the device; otherwise what :meth:`stage`
        lists is sent in one copy of its own."""
        if staged is None or not staged.still(sequences, self._departures):
            staged = self.stage(sequences, extensions)
        sent = staged.rider.tensor
        if sent is None:
            sent = to_device(staged.rider.values, self.device)
        count = len(sequences)
        slots, position_tensor = sent[:count], sent[count : 2 * count]
        selected: dict[Any, list[int]] = {}
        offset = 2 * count
        for key, rows in staged.selected.items():
            listed = selected[key] = RowList(rows)
            if 0 < len(rows) < count:
                listed.on_device = sent[offset : offset + len(rows)]
                offset += len(rows)
        # staged, even when none: the sampler then has nothing to work out
        bans = None if self.eos_token_ids is None else sent[offset : offset + 2 * staged.bans].view(2, staged.bans)
        sampling = selected.get(SAMPLING_ROWS)
        uniforms = None
        if sampling:
            assert self._seeds.tensor is not None
            uniforms = draw_uniforms(self._seeds.tensor.index_select(0, slots), position_tensor)
        sampling_set = set(sampling or ())
        keys = [(seq.seed, len(seq.token_ids)) if i in sampling_set else None for i, seq in enumerate(sequences)]
        return BatchRows(
            params=[seq.params for seq in sequences],
            prompt_token_ids=[seq.prompt_token_ids for seq in sequences],
            output_token_ids=[seq.token_ids for seq in sequences],
            extensions=extensions,
            generators=DrawGenerators(keys, self.device),
            uniforms=uniforms,
            slots=slots,
            slot_list=staged.slot_list,
            output_counts=self._counts.tensor if self._counted else None,
            selected=selected,
            min_tokens_bans=bans,
        )

    def record(self, rows: BatchRows, token_ids: torch.Tensor) -> None:
        """The step drew ``token_ids`` (``[B]``, on the device) for ``rows``: count them."""
        if self._counted and rows.slots is not None and rows.slot_list:
            # every row is counted (cheaper than picking the counted ones); a slot's counts are
            # reset when a sequence joins it, so the table must reach the highest slot of the step
            self._counts.row(max(rows.slot_list), self.device)
            table = self._counts.tensor
            assert table is not None
            ones = torch.ones_like(token_ids, dtype=torch.int32)
            table.index_put_((rows.slots, token_ids.long()), ones, accumulate=True)


class _Row:
    """A sequence's sampling view, for rows built outside the engine (:func:`rows_for`)."""

    def __init__(self, params, prompt_token_ids: list[int], token_ids: list[int], seed: int) -> None:
        self.params, self.prompt_token_ids, self.token_ids, self.seed = params, prompt_token_ids, token_ids, seed


def rows_for(policies: list[Any], vocab_size: int, params: list[Any],
             prompt_token_ids: list[list[int]] | None = None, output_token_ids: list[list[int]] | None = None,
             extensions: list[dict[str, Any]] | None = None, seeds: list[int] | None = None,
             device: torch.device | str = "cpu") -> BatchRows:  # fmt: skip
    """The :class:`BatchRows` of a batch that joined a fresh :class:`PersistentBatch` of
    ``policies``, as the engine builds them: for tests, and for plugin authors exercising their
    processors through the engine's own path. Omitted lists default to ``[1]`` prompts, no output,
    no extensions and seeds ``0, 1, ...``."""
    count = len(params)
    batch = PersistentBatch([p for p in policies if isinstance(p, LogitsProcessor)],
                            [p for p in policies if not isinstance(p, LogitsProcessor)], vocab_size, device)  # fmt: skip
    sequences = [
        _Row(params[i], (prompt_token_ids or [[1]] * count)[i], (output_token_ids or [[] for _ in params])[i],
             (seeds or list(range(count)))[i])  # fmt: skip
        for i in range(count)
    ]
    return batch.rows(sequences, extensions or [{} for _ in params])  # type: ignore[arg-type]
