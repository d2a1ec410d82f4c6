"""Continuous batching: one step of the engine loop at a time, on the engine's thread.

Each :meth:`Batcher.step`:

1. ends aborted requests (their choices finish with ``"abort"`` and their blocks are released);
2. asks the scheduler for the step's work: a token for every decoding sequence, then prefill
   chunks (running prompts, recomputes, newcomers) under the token budget;
3. runs it as one forward over the paged KV cache (:class:`ModelRunner`);
4. gathers prompt logprobs from the chunks that asked (their logits are dropped at once), samples
   a token for every sequence whose chunk reached its end — a request's prompt is prefilled once
   and its first token drawn ``n`` times from the same logits, after which its children fork:
   they share the prompt's full blocks and copy only the last partial one —, releases the blocks
   of finished sequences, and emits every request's progress in one call: at once on a CPU; on a
   GPU once the next step's forward is launched, so that sending overlaps the device's work
   (:attr:`Batcher.overlap`).

A fault in the forward fails the requests that were in it (their KV state is unknown); requests
that were not scheduled in that step go on. A fault while sampling (a plugin processor) is retried
request by request, so only the requests whose rows fail end with an in-band error; a row the
sampler cannot sample (every token excluded) ends its request in-band too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from gyrfalcon.engine.model.heads import StepHeads
from gyrfalcon.engine.model.runner import ModelRunner, Work
from gyrfalcon.engine.model.work import StepWorks, draw_rows
from gyrfalcon.engine.request_state import RequestState, Sequence
from gyrfalcon.engine.sample.persistent_batch import PersistentBatch, StagedRows
from gyrfalcon.engine.sample.sampler import Sampler, SamplerOutput
from gyrfalcon.engine.scheduler import Scheduled, Scheduler
from gyrfalcon.engine.spec import verify
from gyrfalcon.engine.spec.drafter import Drafter
from gyrfalcon.heap import trim_heap
from gyrfalcon.engine_api.types import EngineError, EngineRequest, TokenLogprobs
from gyrfalcon.policies import to_device

log = logging.getLogger(__name__)


class Batcher:
    """The step loop's body over the scheduler's running requests; driven by :meth:`step`."""

    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        scheduler: Scheduler,
        emit: Callable[[list[RequestState]], None],
        count: Callable[[str, int], None],
        fail: Callable[[RequestState, EngineError], None],
        prompt_logprobs: Callable[[EngineRequest, torch.Tensor, int], TokenLogprobs] | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        """``emit`` sends what a step changed, every request's progress in one call; ``fail`` ends a
        request in-band with an error (a no-op for a request already closed); ``prompt_logprobs(request, logits, start)`` returns
        the prompt logprobs of the positions that ``[c, V]`` logits starting at ``start`` predict.
        The sampling state of the sequences lives in a :class:`PersistentBatch` that they join
        when they first draw and leave when the scheduler releases their KV. ``drafter``: the
        draft tokens of sequences that speculate (:mod:`gyrfalcon.engine.spec.drafter`; None: none do)."""
        self.runner = runner
        self.sampler = sampler
        self.scheduler = scheduler
        self.batch = PersistentBatch(sampler.processors, sampler.gatherers, runner.logits_width, runner.cache.device,
                                     sampler.eos_token_ids)  # fmt: skip
        scheduler.release_listeners.append(self.batch.leave)
        scheduler.release_listeners.append(runner.block_table.release)
        self.emit = emit
        #: a step's outputs are sent once the next step's forward is launched, so that on a GPU the
        #: host's work of sending them overlaps the device's of computing the next step (on a CPU
        #: the forward runs on the host, and waiting for it would only delay the outputs)
        self.overlap = runner.device.type == "cuda"
        self._unsent: list[RequestState] = []
        self.count = count
        self.fail = fail
        self.prompt_logprobs = prompt_logprobs
        self.drafter = drafter
        if drafter is not None:
            scheduler.release_listeners.append(drafter.forget)

    # ----------------------------------------------------------------- views (read from any thread)

    @property
    def running_sequences(self) -> int:
        return sum(len(state.live_sequences()) for state in list(self.scheduler.running))

    def running_requests(self) -> int:
        return len(self.scheduler.running)

    def prefilling_requests(self) -> int:
        return sum(1 for state in list(self.scheduler.running) if not state.forked and not state.sequences[0].token_ids)

    @property
    def idle(self) -> bool:
        return not self.scheduler.running

    def states(self) -> list[RequestState]:
        """Every running request."""
        return list(self.scheduler.running)

    # ----------------------------------------------------------------- the step

    @torch.inference_mode()
    def step(self) -> bool:
        """Run one step; False when there was nothing to do."""
        self._reap_aborted()
        plan = self.scheduler.schedule()
        if not plan:
            self.send()
            return False
        ends = [item.reaches_end for item in plan]
        draws = self._draws(plan, ends)
        drafts = verify.drafts_of(plan, draws, self.drafter, self.scheduler)
        staged = self._stage(plan, draws)
        works = StepWorks([self._work(item) for item in plan] + verify.draft_works(plan, drafts),
                          staged.rider if staged is not None else None)  # fmt: skip
        carried = self._carry_draw_rows(works, draws, staged)
        try:
            heads, spans = self.runner.step(works)
        except Exception:  # noqa: BLE001 - find the request(s) at fault; the others go on
            log.exception("a forward of %d sequence(s) failed; retrying request by request", len(plan))
            plan, works, heads, spans = self._forward_apart(plan, works)
            if not plan:
                return True
            ends = [item.reaches_end for item in plan]
            draws, staged = self._draws(plan, ends), None
            drafts = [[] for _ in plan]  # the works of a failed step's drafts are gone with it
        self.send()  # the previous step's outputs, while the device computes this step (overlap)
        logits = heads.logits
        self._count_forward(plan)
        for item in plan:
            item.seq.computed += item.count
            self.scheduler.register_full_blocks(item.state, item.seq)
        rows: list[int] = []
        sampled: list[tuple[Sequence, RequestState]] = []
        running = set(self.scheduler.running)
        for item, work, (first, count), reaches_end, drawing in zip(plan, works, spans, ends, draws):
            state = item.state
            if state.closed or state.abort_requested or state not in running:  # it ended during the forward
                continue
            if work.logits == "all":
                try:
                    self._gather_prompt_logprobs(item, logits[first : first + count])
                except Exception as exc:  # noqa: BLE001 - the request's own gather failed
                    self._fail_states([state], exc)
                    continue
            if reaches_end and not state.forked and state.request.sampling.max_tokens == 0:
                for seq in state.sequences:  # prompt logprobs only: nothing to generate
                    seq.finish("length")
                continue
            for seq in drawing:
                rows.append(first + count - 1)
                sampled.append((seq, state))
        if rows:
            if rows == list(range(logits.shape[0])):  # a decode step: every row drawn, in order
                self._sample(heads, sampled, staged)
            else:
                index = self._draw_index(rows, staged, carried, logits.device)
                self._sample(StepHeads(logits.index_select(0, index)), sampled, staged)
        if any(drafts):
            verify.draw_in_turns(plan, drafts, spans[len(plan) :], logits, self._sample, self.drafter, self.scheduler)
        self._settle(plan)
        return True

    def _draws(self, plan: list[Scheduled], ends: list[bool]) -> list[list[Sequence]]:
        """Per item, the sequences that draw a token from its last row this step: its request's
        every choice at the end of the prompt, its own sequence after the fork; none while the
        request is ending or asks for prompt logprobs only."""
        draws: list[list[Sequence]] = []
        for item, end in zip(plan, ends):  # every planned request is running: schedule() drops the preempted
            state = item.state
            if not end or state.closed or state.abort_requested:
                draws.append([])
            elif state.forked:
                draws.append([item.seq])
            else:
                draws.append([] if state.request.sampling.max_tokens == 0 else list(state.sequences))
        return draws

    def _stage(self, plan: list[Scheduled], draws: list[list[Sequence]]) -> StagedRows | None:
        """Before the forward: the rows the step will draw, staged in the persistent batch so that
        what they need on the device travels with the step's inputs (None when no row draws, or a
        policy refuses a row: the sampling then finds whose request it is and fails only that)."""
        sequences = [seq for drawing in draws for seq in drawing]
        if not sequences:
            return None
        extensions = [item.state.request.extensions for item, drawing in zip(plan, draws) for _ in drawing]
        try:
            return self.batch.stage(sequences, extensions)
        except Exception:  # noqa: BLE001 - a policy's add_row raised: _sample retries request by request
            return None

    @staticmethod
    def _carry_draw_rows(works: list[Work], draws: list[list[Sequence]],
                         staged: StagedRows | None) -> tuple[list[int], int] | None:  # fmt: skip
        """The rows of the step's logits it will draw from, where that is not every row in order (a
        prefill's last row, a request's first token drawn ``n`` times), carried with the step's
        inputs: ``(rows, offset in the rider)``; None when there is nothing to carry."""
        if staged is None:
            return None
        rows, every_row = draw_rows(works, draws)
        return None if every_row else (rows, staged.rider.carry(rows))

    @staticmethod
    def _draw_index(rows: list[int], staged: StagedRows | None, carried: tuple[list[int], int] | None,
                    device: torch.device) -> torch.Tensor:  # fmt: skip
        """``rows`` on the device: what the step carried where they are still the same rows (none
        ended during the forward), else a copy of their own."""
        same = staged is not None and carried is not None and carried[0] == rows
        index = staged.rider.part(carried[1], len(rows)) if same else None  # type: ignore[union-attr,index]
        return index if index is not None else to_device(rows, device)

    def _forward_apart(self, plan: list[Scheduled], works: list[Work]):
        """Run each request's part of a failed forward on its own (rewriting a slot with the same
        token's KV is harmless); requests whose part fails again end in-band. Returns what
        succeeded as ``(plan, works, heads, spans)``, with one logits tensor as a whole forward."""
        kept_plan: list[Scheduled] = []
        kept_works: list[Work] = []
        parts: list[torch.Tensor] = []
        spans: list[tuple[int, int]] = []
        rows = 0
        for state in dict.fromkeys(item.state for item in plan):
            mine = [i for i, item in enumerate(plan) if item.state is state]
            try:
                part, own = self.runner.step([works[i] for i in mine])
            except Exception as exc:  # noqa: BLE001
                self._fail_states([state], exc)
                continue
            kept_plan.extend(plan[i] for i in mine)
            kept_works.extend(works[i] for i in mine)
            spans.extend((rows + first, count) for first, count in own)
            parts.append(part.kept_logits())  # the next request's step may write the shared buffers
            rows += part.logits.shape[0]
        return kept_plan, kept_works, StepHeads(torch.cat(parts) if parts else torch.empty(0)), spans

    def _work(self, item: Scheduled) -> Work:
        seq, state = item.seq, item.state
        stop = seq.computed + item.count
        wants_prompt_logprobs = (
            self.prompt_logprobs is not None
            and state.request.sampling.prompt_logprobs is not None
            and not state.forked
            and stop > state.prompt_logprobs_done
            and seq.computed <= state.prompt_logprobs_done
        )
        kind = "all" if wants_prompt_logprobs else ("last" if item.reaches_end else "none")
        return Work(seq.tokens(seq.computed, stop), seq.computed, seq.blocks, kind, owner=seq)

    def _count_forward(self, plan: list[Scheduled]) -> None:
        prompt_tokens = 0
        for item in plan:
            prompt_len = len(item.seq.prompt_token_ids)
            if item.seq.computed < prompt_len and not (item.state.forked or item.seq.token_ids):
                prompt_tokens += min(item.count, prompt_len - item.seq.computed)
        decode_only = all(item.count == 1 for item in plan)
        self.count("decode_forwards" if decode_only else "prefill_forwards", 1)
        if prompt_tokens:
            self.count("prompt_tokens", prompt_tokens)

    def _gather_prompt_logprobs(self, item: Scheduled, logits: torch.Tensor) -> None:
        """Prompt logprobs of a chunk (positions not gathered before), joined to the request's."""
        assert self.prompt_logprobs is not None
        state = item.state
        start = item.seq.computed - item.count
        skip = state.prompt_logprobs_done - start
        part = self.prompt_logprobs(state.request, logits[skip:], start + skip)
        if state.prompt_logprobs is None:
            state.prompt_logprobs = TokenLogprobs()
        state.prompt_logprobs.extend(part)
        state.prompt_logprobs_done = min(start + len(logits), len(state.request.prompt_token_ids))

    def _sample(self, heads: StepHeads, rows: list[tuple[Sequence, RequestState]], staged: StagedRows | None) -> None:
        """Sample every row (with what :meth:`_stage` sent of them, where they are still the same
        rows); if the sampler raises, retry request by request and fail only those whose rows raise
        again."""
        sequences = [seq for seq, _ in rows]
        owners = [state for _, state in rows]
        try:
            batch_rows = self.batch.rows(sequences, [state.request.extensions for state in owners], staged)
            result = self.sampler.sample(heads.logits, batch_rows, heads)
        except Exception:  # noqa: BLE001 - find the request(s) at fault
            log.exception("sampling a batch failed; retrying request by request")
            for state in dict.fromkeys(owners):
                mine = [i for i, owner in enumerate(owners) if owner is state]
                index = torch.tensor(mine, dtype=torch.long, device=heads.logits.device)
                try:
                    own_rows = self.batch.rows([sequences[i] for i in mine], [state.request.extensions] * len(mine))
                    part = self.sampler.sample(heads.logits.index_select(0, index), own_rows)
                except Exception as exc:  # noqa: BLE001
                    self._fail_states([state], exc)
                    continue
                self.batch.record(own_rows, part.device_ids)
                self._append([sequences[i] for i in mine], [state] * len(mine), part)
            return
        self.batch.record(batch_rows, result.device_ids)
        self._append(sequences, owners, result)

    def _append(self, sequences: list[Sequence], owners: list[RequestState], sampled: SamplerOutput) -> None:
        """Append each row's token; a request with a row the sampler could not sample
        (``sampled.errors``) gets no token and ends with that error (its choices finish)."""
        failed: dict[int, EngineError] = {}
        for row, error in sampled.errors.items():
            failed.setdefault(id(owners[row]), error)
        appended = 0
        for seq, owner, token_id, logprobs in zip(sequences, owners, sampled.token_ids, sampled.logprobs):
            if id(owner) not in failed:
                seq.append(token_id, logprobs)
                appended += 1
        self.count("generation_tokens", appended)
        for state in dict.fromkeys(owners):
            if id(state) in failed:
                self.fail(state, failed[id(state)])
                self.scheduler.finish_request(state)
            elif not state.forked:  # after its first token
                self.runner.cache.copy_blocks(self.scheduler.fork(state))

    def send(self) -> None:
        """Emit the outputs not sent yet, in one call."""
        if self._unsent:
            states, self._unsent = list(dict.fromkeys(self._unsent)), []
            self.emit(states)

    def _settle(self, plan: list[Scheduled]) -> None:
        """Queue the step's progress (sent now, or with :attr:`overlap` after the next step's forward
        is launched); release finished sequences and requests."""
        self.count("steps", 1)
        for state in dict.fromkeys(item.state for item in plan):
            if state.closed:
                continue
            if state.abort_requested:  # the client left during this step
                state.abort()
            for seq in state.sequences:
                if seq.finished and (seq.blocks or self.batch.slot(seq) is not None):
                    self.scheduler.release(seq)
            self._unsent.append(state)
            if state.finished:
                self.scheduler.finish_request(state)
        if not self.overlap:
            self.send()
        if not self.scheduler.running and len(self.scheduler) == 0:
            trim_heap()  # freed heap pages back to the system

    # ----------------------------------------------------------------- ending requests

    def abort_all(self) -> None:
        """Finish every running request with ``"abort"`` (shutdown)."""
        for state in self.states():
            state.abort_requested = True
        self._reap_aborted()
        self.send()

    def clear(self) -> list[RequestState]:
        """Forget every running request (after a failed step); return them, their blocks released.
        What earlier steps left unsent is sent first."""
        self.send()
        states = self.states()
        for state in states:
            self.scheduler.finish_request(state)
        return states

    def _fail_states(self, states: list[RequestState], exc: Exception) -> None:
        log.error("a step failed for %d request(s)", len(states), exc_info=exc)
        error = EngineError(f"internal error: {exc}")
        for state in states:
            self.scheduler.finish_request(state)
            self.fail(state, error)

    def _reap_aborted(self) -> None:
        """End aborted requests, and the choices the client finished (a stop string in their text)."""
        for state in self.states():
            if state.closed:  # ended elsewhere (an abort while it was being admitted): let it go
                self.scheduler.finish_request(state)
                continue
            if state.abort_requested:
                state.abort()
            while state.finish_requested:
                index, stop_reason = state.finish_requested.popitem()
                seq = state.sequences[index]
                seq.finish("stop", stop_reason)
                self.scheduler.release(seq)
            if state.finished:
                self.scheduler.finish_request(state)
                self._unsent.append(state)
        if not self.overlap:
            self.send()
