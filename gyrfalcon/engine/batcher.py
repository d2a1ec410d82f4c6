"""Continuous batching: one step of the engine loop at a time, on the engine's thread.

Each :meth:`Batcher.step`:

1. drops the rows of aborted requests (their choices finish with ``"abort"`` at once);
2. when no prefill is in progress, asks the scheduler for the next group of newcomers (equal prompt
   lengths) and starts prefilling it into a KV batch of its own;
3. runs one prefill chunk of that group; after its last chunk the first token of every child is
   sampled from the prompt's logits (the cache of an ``n``-choice request is forked ``n`` times
   from its single prefill), and the children that go on are merged into the running batch;
4. runs one decode step — a single batched forward — for every running sequence, samples, emits,
   and lets finished sequences leave the batch at once.

A fault in step 2 or 3 (a forward, a plugin processor, the prompt-logprob gather, an OOM in the
merge) fails the prefill group's requests in-band and nothing else: the prefill has a KV batch of
its own, and :meth:`PaddedKVBatch.merge` leaves the running batch as it was when it raises. A fault
in step 4 propagates (the running batch's KV state is unknown); the engine then fails everything
:meth:`Batcher.clear` returns. A row the sampler cannot sample (every token excluded) ends its
request with the sampler's in-band error; the other rows go on.

Prompt logprobs are gathered chunk by chunk, for the rows that asked only, and each chunk's
``[k, c, V]`` logits are dropped at once (they are never kept for the whole prompt).

A long prompt is prefilled chunk by chunk with decode steps in between, so running streams keep
moving. Emission and bookkeeping go through the callbacks the engine passes in.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gyrfalcon.engine.kv_cache import PaddedKVBatch
from gyrfalcon.engine.outputs import RequestState
from gyrfalcon.engine.runner import ModelRunner
from gyrfalcon.engine.sampler import Sampler
from gyrfalcon.engine.scheduler import Scheduler
from gyrfalcon.engine.sequence import Sequence
from gyrfalcon.engine.types import EngineError, EngineRequest, TokenLogprobs
from gyrfalcon.policies import BatchRows

log = logging.getLogger(__name__)


def batch_rows(sequences: list[Sequence], owners: list[RequestState]) -> BatchRows:
    """The per-row view of a batch that processors and gatherers receive."""
    return BatchRows(
        params=[seq.params for seq in sequences],
        prompt_token_ids=[seq.prompt_token_ids for seq in sequences],
        output_token_ids=[seq.token_ids for seq in sequences],
        extensions=[state.request.extensions for state in owners],
        generators=[seq.generator for seq in sequences],
    )


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _load_malloc_trim()


def _release_memory() -> None:
    """Give freed heap pages back to the OS (glibc only; a no-op elsewhere)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@dataclass
class PrefillJob:
    """A group of newcomers with equal prompt lengths being prefilled together, chunk by chunk."""

    states: list[RequestState]
    kv: PaddedKVBatch
    done: int = 0  # prompt positions prefilled so far
    #: per row that asked for prompt logprobs, the positions gathered so far (chunk by chunk)
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.states[0].request.prompt_token_ids)

    def prompt_logprob_rows(self) -> list[int]:
        """The rows (still wanted) whose request asked for prompt logprobs."""
        return [i for i, s in enumerate(self.states)
                if s.request.sampling.prompt_logprobs is not None and not s.abort_requested]  # fmt: skip


class Batcher:
    """The running batch and the prefill in progress; driven by :meth:`step` on one thread."""

    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        scheduler: Scheduler,
        emit: Callable[[RequestState], None],
        count: Callable[[str, int], None],
        fail: Callable[[RequestState, EngineError], None],
        prompt_logprobs: Callable[[EngineRequest, torch.Tensor, int], TokenLogprobs] | None = None,
    ) -> None:
        """``emit`` sends a request's progress; ``fail`` ends a request in-band with an error (a
        no-op for a request already closed); ``prompt_logprobs(request, logits, start)`` returns
        the prompt logprobs of the positions that ``[c, V]`` logits starting at ``start`` predict."""
        self.runner = runner
        self.sampler = sampler
        self.scheduler = scheduler
        self.emit = emit
        self.count = count
        self.fail = fail
        self.prompt_logprobs = prompt_logprobs
        self.kv: PaddedKVBatch | None = None
        self.sequences: list[Sequence] = []
        self.owners: list[RequestState] = []
        self.job: PrefillJob | None = None

    # ----------------------------------------------------------------- views (read from any thread)

    @property
    def running_sequences(self) -> int:
        return len(self.sequences)

    def running_requests(self) -> int:
        return len({id(s) for s in self.owners})

    def prefilling_requests(self) -> int:
        job = self.job
        return 0 if job is None else len(job.states)

    @property
    def idle(self) -> bool:
        return not self.sequences and self.job is None

    # ----------------------------------------------------------------- the step

    @torch.inference_mode()
    def step(self) -> bool:
        """Run one prefill chunk and/or one decode step; False when there was nothing to do."""
        self._reap_aborted()
        worked = False
        if self.job is None:
            width = self.kv.width if self.kv is not None and self.sequences else 0
            group = self.scheduler.admit(len(self.sequences), width)
            if group:
                worked = True
                try:
                    self.job = PrefillJob(group, self.runner.new_batch(len(group)))
                except Exception as exc:  # noqa: BLE001 - fails the group, not the batch
                    self._fail_prefill(group, exc)
        job = self.job
        if job is not None:
            worked = True
            try:
                self._prefill_chunk(job)
            except Exception as exc:  # noqa: BLE001 - the running batch's KV is untouched: it goes on
                if self.job is job:
                    self.job = None
                self._fail_prefill(job.states, exc)
        if self.sequences:
            self._decode()
            worked = True
        return worked

    def abort_all(self) -> None:
        """Finish every running and prefilling request with ``"abort"`` (shutdown)."""
        for state in self.states():
            state.abort_requested = True
        self._reap_aborted()

    def clear(self) -> list[RequestState]:
        """Forget the batch and the prefill (after a failed step); return the requests they held."""
        states = self.states()
        self.kv, self.sequences, self.owners, self.job = None, [], [], None
        return states

    def states(self) -> list[RequestState]:
        """Every request in the batch or in the prefill in progress, once each."""
        seen: dict[int, RequestState] = {id(s): s for s in self.owners}
        if self.job is not None:
            seen.update({id(s): s for s in self.job.states})
        return list(seen.values())

    def _fail_prefill(self, states: list[RequestState], exc: Exception) -> None:
        """Fail the requests of a prefill group in-band (they are in no list any more)."""
        log.error("prefill of %d request(s) failed", len(states), exc_info=exc)
        error = EngineError(f"internal error: {exc}")
        for state in states:
            self.fail(state, error)

    def _reap_aborted(self) -> None:
        aborted = [s for s in self.states() if s.abort_requested and not s.closed]
        if not aborted:
            return
        for state in aborted:
            state.abort()
            self.emit(state)
        job = self.job
        if job is not None and all(s.abort_requested for s in job.states):
            self.job = None
        self._keep([row for row, seq in enumerate(self.sequences) if not seq.finished])

    def _keep(self, keep: list[int]) -> None:
        if len(keep) == len(self.sequences):
            return
        self.sequences = [self.sequences[row] for row in keep]
        self.owners = [self.owners[row] for row in keep]
        assert self.kv is not None
        self.kv.select(keep)
        if not keep:
            self.kv = None
            if self.job is None and len(self.scheduler) == 0:
                _release_memory()

    def _prefill_chunk(self, job: PrefillJob) -> None:
        chunk = max(self.scheduler.prefill_chunk_tokens // len(job.states), 1)
        end = min(job.done + chunk, job.length)
        tokens = [s.request.prompt_token_ids[job.done : end] for s in job.states]
        wanted = job.prompt_logprob_rows() if self.prompt_logprobs is not None else []
        logits = self.runner.forward(job.kv, tokens, all_logits=bool(wanted))
        self.count("prefill_forwards", 1)
        self.count("prompt_tokens", len(job.states) * (end - job.done))
        start, job.done = job.done, end
        if wanted:  # logprob path: this chunk's positions now, then its [k, c, V] logits are dropped
            assert self.prompt_logprobs is not None
            for i in wanted:
                part = self.prompt_logprobs(job.states[i].request, logits[i], start)
                job.prompt_logprobs.setdefault(i, TokenLogprobs()).extend(part)
            logits = logits[:, -1, :].contiguous()
        if job.done < job.length:
            return
        # The job leaves self.job here; step() still fails its requests if what follows raises.
        self.job = None
        self._start_children(job, logits)

    def _start_children(self, job: PrefillJob, logits: torch.Tensor) -> None:
        """Sample each child's first token from its prompt's logits, then merge the survivors."""
        fan: list[int] = []
        sequences: list[Sequence] = []
        owners: list[RequestState] = []
        for i, state in enumerate(job.states):
            if state.abort_requested:  # aborted during its last prefill chunk: it is in no list any more
                state.abort()
                self.emit(state)
                continue
            if i in job.prompt_logprobs:
                state.prompt_logprobs = job.prompt_logprobs[i]
            if state.request.sampling.max_tokens == 0:  # prompt logprobs only: nothing to generate
                for seq in state.sequences:
                    seq.finish("length")
                self.emit(state)
                continue
            fan.extend([i] * len(state.sequences))
            sequences.extend(state.sequences)
            owners.extend([state] * len(state.sequences))
        if not fan:
            return
        index = torch.tensor(fan, dtype=torch.long, device=logits.device)
        sampled = self.sampler.sample(logits.index_select(0, index), batch_rows(sequences, owners))
        self._append(sequences, owners, sampled)
        job.kv.select(fan)  # fork: each child gets a copy of its prompt's cache
        keep = [row for row, seq in enumerate(sequences) if not seq.finished]
        if not keep:
            return
        job.kv.select(keep)
        if self.kv is None or not self.sequences:
            self.kv = job.kv
        else:
            self.kv.merge(job.kv)  # leaves self.kv as it was if it raises (an OOM)
        self.sequences.extend(sequences[row] for row in keep)
        self.owners.extend(owners[row] for row in keep)

    def _decode(self) -> None:
        assert self.kv is not None
        logits = self.runner.decode(self.kv, [seq.token_ids[-1] for seq in self.sequences])
        self.count("decode_forwards", 1)
        sampled = self.sampler.sample(logits, batch_rows(self.sequences, self.owners))
        self._append(self.sequences, self.owners, sampled)
        self._keep([row for row, seq in enumerate(self.sequences) if not seq.finished])

    def _append(self, sequences: list[Sequence], owners: list[RequestState], sampled) -> None:
        """Append each row's token and emit; a request with a row the sampler could not sample
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
        self.count("steps", 1)
        for state in dict.fromkeys(owners):
            if id(state) in failed:
                self.fail(state, failed[id(state)])
            else:
                self.emit(state)
