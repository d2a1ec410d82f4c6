"""The scheduler: a bounded queue of waiting requests, the running requests, and KV blocks for both.

Every sequence has tokens (prompt, then generated) and ``computed`` of them with KV in its blocks;
a step feeds each scheduled sequence its next uncomputed tokens. :meth:`Scheduler.schedule` builds
one step under ``max_num_batched_tokens``:

1. every running sequence with one token to feed (decoding) gets it — running streams never wait
   behind a prompt —, up to ``max_num_seqs`` of them: a request with more choices than that (``n``
   up to ``max_request_seqs``) decodes them in turns, oldest first;
2. running sequences with more to feed (a chunked prefill, a recompute) get the next chunk of at
   most ``prefill_chunk_tokens``, oldest request first; a chunk that stops short of the prompt's
   end stops at a block boundary (:meth:`Scheduler._chunk`);
3. waiting requests are admitted in queue order while the running sequences plus their ``n`` stay
   within ``max_num_seqs`` (a larger request waits until it runs alone) and blocks are free for
   their first chunk; a request that must wait for seats does not stop narrower ones behind it
   that fit the free seats and surely end before its seats are surely free (:meth:`Scheduler._admit`);
   prefix-cache hits are counted as computed. A request is prefilled once; its ``n`` children fork after its first
   token, sharing the prompt's full blocks (:meth:`Scheduler.fork`).

Blocks are taken as tokens need them. When none is free, the last running request is preempted
whole — every child together: its blocks are released, its tokens kept, and it returns to its place
in the queue to be recomputed later (vLLM's recompute preemption). An admitted request is never
failed for lack of cache: :meth:`check_fits` refuses at submit a request that could not run even
alone.

Order: both the queue and the running list are kept sorted by ``(priority, arrival)``. Under the
``fcfs`` policy every priority counts as 0, so that is arrival order: oldest first, newest preempted
first, a preempted request back at the head. Under ``priority`` (vLLM's policy) a lower
``EngineRequest.priority`` is admitted earlier, decodes first when rows are short, and is preempted
last; equal priorities keep arrival order.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gyrfalcon.engine.kv import prefix
from gyrfalcon.engine.kv.blocks import BlockPool, NoFreeBlocks
from gyrfalcon.engine.request_state import RequestState, Sequence
from gyrfalcon.engine_api.errors import QueueFull
from gyrfalcon.errors import RequestError


#: ``fcfs``: arrival order; ``priority``: lower ``EngineRequest.priority`` first (vLLM's policies)
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class Scheduled:
    """``count`` tokens of ``seq`` (of request ``state``) fed in this step from ``seq.computed``."""

    state: RequestState
    seq: Sequence
    count: int

    @property
    def reaches_end(self) -> bool:
        """The chunk ends at the sequence's last token: its logits give the next token."""
        return self.seq.computed + self.count == self.seq.num_tokens


class Scheduler:
    """Thread-safe waiting queue (``add``/``remove`` from any thread) and the step plan (engine thread)."""

    def __init__(
        self,
        max_queue_len: int,
        max_num_seqs: int = 1,
        max_num_batched_tokens: int = 1 << 30,
        prefill_chunk_tokens: int = 512,
        pool: BlockPool | None = None,
        policy: str = "fcfs",
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; one of {', '.join(SCHEDULING_POLICIES)}")
        self.max_queue_len = max_queue_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.pool = pool
        self.policy = policy
        self._arrivals = itertools.count()
        #: waiting requests in (priority, arrival) order
        self._waiting: list[RequestState] = []
        self._cond = threading.Condition()
        #: admitted requests in (priority, arrival) order (engine thread only)
        self.running: list[RequestState] = []
        self.preemptions = 0
        #: called with each sequence whose KV is released (engine thread)
        self.release_listeners: list[Callable[[Sequence], None]] = []
        #: what a waiting request needs beyond seats and blocks (its LoRA adapter in a slot), asked
        #: before it is admitted (engine thread): True admits it, False leaves it waiting (later
        #: ones may pass), None says it was taken out of the queue (failed)
        self.admission_check: Callable[[RequestState], bool | None] | None = None
        #: which weights compute KV from now on: one more at each swap (:meth:`weights_replaced`)
        self.weights_epoch = 0

    def __len__(self) -> int:
        return len(self._waiting)

    # ----------------------------------------------------------------- the queue (any thread)

    def add(self, state: RequestState, counted: bool = False) -> None:
        """Enqueue, or raise :class:`QueueFull` (a 503 with ``Retry-After``) when the queue is full:
        when ``max_queue_len`` requests wait beyond those the free running seats will take at the
        next step (requests sent at once, or right after others were answered, reach the queue
        before the engine admits them: up to ``max_num_seqs`` of them are not queued but about to run).
        ``counted``: a request whose place was counted when it came (held through a pause)."""
        with self._cond:
            if not counted and self._queued() >= self.max_queue_len:
                raise QueueFull(f"the server is busy: {self.max_queue_len} requests are already waiting")
            state.arrival = next(self._arrivals)
            bisect.insort(self._waiting, state, key=self.order)
            self._cond.notify()

    def _queued(self) -> int:
        """How many waiting requests the running seats free now will not take (under ``_cond``)."""
        seats = self.max_num_seqs - sum(len(running.unfinished()) for running in tuple(self.running))
        for index, waiting in enumerate(self._waiting):
            seats -= len(waiting.sequences)
            if seats < 0:
                return len(self._waiting) - index
        return 0

    def order(self, state: RequestState) -> tuple[int, int]:
        """A request's place in the queue and the running list (see the module docstring)."""
        return (state.request.priority if self.policy == "priority" else 0, state.arrival)

    def remove(self, request_id: str) -> RequestState | None:
        """Take a waiting request out of the queue (None when it is not waiting)."""
        with self._cond:
            for state in self._waiting:
                if state.request_id == request_id:
                    self._waiting.remove(state)
                    return state
        return None

    def wait(self, timeout: float) -> None:
        """Block until a request arrives (or :meth:`wake`, or ``timeout`` seconds)."""
        with self._cond:
            if not self._waiting:
                self._cond.wait(timeout)

    def drain(self) -> list[RequestState]:
        """Remove and return every waiting request."""
        with self._cond:
            states = list(self._waiting)
            self._waiting.clear()
            return states

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ----------------------------------------------------------------- blocks

    def blocks_for(self, tokens: int) -> int:
        assert self.pool is not None
        return -(-tokens // self.pool.block_size)

    def check_fits(self, prompt_len: int, max_tokens: int, n: int) -> None:
        """Refuse (400) a request whose sequences could not hold their KV even with the cache to themselves."""
        if self.pool is None:
            return
        capacity = self.pool.usable_blocks
        prompt_blocks = self.blocks_for(prompt_len)
        if prompt_blocks > capacity:
            raise RequestError(f"the prompt ({prompt_len} tokens) does not fit this server's KV cache "
                               f"({capacity * self.pool.block_size} tokens)", "prompt")  # fmt: skip
        worst = n * self.blocks_for(prompt_len + max_tokens)
        if worst > capacity:
            raise RequestError(f"n × (prompt + max_tokens) = {n} × {prompt_len + max_tokens} tokens does not fit "
                               f"this server's KV cache ({capacity * self.pool.block_size} tokens)", "max_tokens")  # fmt: skip

    def reserve(self, seq: Sequence, count: int) -> bool:
        """Blocks for ``count`` tokens from ``seq``'s computed ones (a step's draft rows beside its
        planned token); False, taking none, when too few are free."""
        return self._reserve(seq, count)

    def _reserve(self, seq: Sequence, count: int) -> bool:
        """Blocks for ``seq``'s tokens up to ``computed + count`` (False, taking none, if too few are free)."""
        assert self.pool is not None
        need = self.blocks_for(seq.computed + count) - len(seq.blocks)
        if need > self.pool.num_free:
            return False
        seq.blocks.extend(self.pool.allocate() for _ in range(max(need, 0)))
        return True

    def release(self, seq: Sequence) -> None:
        """Give back a sequence's blocks (finished, aborted or preempted); its KV is gone. Every
        ``release_listeners`` callable hears of it (the persistent batch frees the sequence's slot)."""
        if self.pool is not None and seq.blocks:
            self.pool.release(seq.blocks)
        seq.blocks, seq.computed, seq.block_hashes = [], 0, []
        for listener in self.release_listeners:
            listener(seq)

    def finish_request(self, state: RequestState) -> None:
        """A request leaves: its blocks are released and it is no longer running."""
        for seq in state.sequences:
            self.release(seq)
        if state in self.running:
            self.running.remove(state)

    def fork(self, state: RequestState) -> list[tuple[int, int]]:
        """After a request's first token: every other choice shares the prompt's full blocks and gets
        a block of its own for the last partial one (without a free block it recomputes that part
        instead). Returns the ``(source, copy)`` blocks whose KV the cache must copy."""
        assert self.pool is not None
        state.forked = True
        parent = state.sequences[0]
        full, partial = divmod(parent.computed, self.pool.block_size)
        copies = []
        for child in state.sequences[1:]:
            if child.finished:
                continue
            child.blocks = [self.pool.share(block) for block in parent.blocks[:full]]
            child.block_hashes = list(parent.block_hashes[:full])
            child.cache_epoch = parent.cache_epoch
            child.computed = full * self.pool.block_size
            if partial:
                try:
                    block = self.pool.allocate()
                except NoFreeBlocks:
                    continue
                copies.append((parent.blocks[full], block))
                child.blocks.append(block)
                child.computed = parent.computed
        return copies

    def _preempt(self, state: RequestState) -> None:
        for seq in state.sequences:
            self.release(seq)
        self.running.remove(state)
        with self._cond:
            bisect.insort(self._waiting, state, key=self.order)
        self.preemptions += 1

    def weights_replaced(self) -> None:
        """The weights change between this step and the next (engine thread): KV computed from now
        on is another epoch's (:mod:`gyrfalcon.engine.kv.prefix`)."""
        self.weights_epoch += 1

    def _prefix_hit(self, state: RequestState, seq: Sequence) -> None:
        """A fresh sequence: its KV begins in this epoch of the weights, and its cached full blocks count as computed."""
        assert self.pool is not None
        seq.cache_epoch = self.weights_epoch
        if state.request.sampling.prompt_logprobs is None or state.prompt_logprobs_done >= len(seq.prompt_token_ids):
            prefix.start_from_cache(self.pool, seq, state.request.cache_salt)  # prompt logprobs need the prompt's logits

    def register_full_blocks(self, state: RequestState, seq: Sequence) -> None:
        """After a forward: record the prefix-cache key of every block the step filled."""
        assert self.pool is not None
        prefix.register_full_blocks(self.pool, seq, state.request.cache_salt)

    # ----------------------------------------------------------------- the step plan (engine thread)

    def running_sequences(self) -> int:
        return sum(len(state.unfinished()) for state in self.running)

    def schedule(self) -> list[Scheduled]:
        """The next step's work (see the module docstring); may preempt the newest requests."""
        budget = self.max_num_batched_tokens
        plan: list[Scheduled] = []
        preemptions = self.preemptions
        rows = 0  # decode rows: at most max_num_seqs (a request with more choices runs them in turns)
        decode: list[tuple[RequestState, Sequence]] = []
        prefill: list[tuple[RequestState, Sequence]] = []
        for state in self.running:  # one look at every sequence: decode rows first, then prefill chunks
            for seq in state.live_sequences():
                want = seq.num_tokens - seq.computed
                if want == 1:
                    decode.append((state, seq))
                elif want > 1:
                    prefill.append((state, seq))
        for decoding, pending in ((True, decode), (False, prefill)):
            for state, seq in pending:
                if budget <= 0:
                    break
                if self.preemptions != preemptions and state not in self.running:
                    continue  # preempted in this step (by an older request, or for want of its own blocks)
                if decoding:
                    if rows >= self.max_num_seqs:
                        continue
                    rows += 1
                count = self._chunk(seq, budget)
                if count <= 0:
                    continue
                if not self._make_room(seq, count, state, plan):
                    continue
                plan.append(Scheduled(state, seq, count))
                budget -= count
        if self.preemptions == preemptions:  # no admission while blocks are short
            self._admit(plan, budget)
        return plan

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """How many of ``seq``'s tokens to feed this step: a chunk that stops short of the end stops
        at a block boundary, where the attention cuts its query groups anyway
        (:func:`~gyrfalcon.engine.model.attention.block_groups`), so a prompt's rows are computed
        alike however its prefill is chunked."""
        want = seq.num_tokens - seq.computed
        count = min(want, budget, self.prefill_chunk_tokens)
        if count < want and self.pool is not None:
            aligned = count - (seq.computed + count) % self.pool.block_size
            if aligned > 0:
                count = aligned
            elif budget < min(want, self.prefill_chunk_tokens):
                count = 0  # what is left of the step's budget holds no block: wait for the next step
            # else chunks smaller than a block (prefill_chunk_tokens below the block size) cut inside one
        return count

    def _make_room(self, seq: Sequence, count: int, state: RequestState, plan: list[Scheduled]) -> bool:
        while not self._reserve(seq, count):
            victim = self.running[-1]
            self._preempt(victim)
            plan[:] = [s for s in plan if s.state is not victim]
            if victim is state:
                return False
        return True

    def _admit(self, plan: list[Scheduled], budget: int) -> None:
        """Admit waiting requests in queue order (module docstring, 3). The first one wider than
        the free seats waits for them; a later one may pass it only if it fits the seats free now
        and surely ends (its prefill and ``max_tokens``, in steps) before the wider one's seats are
        surely free (:meth:`_seats_free_within`): it uses seats that would stay idle, and the wider
        request starts no later than it would have without it."""
        rows = self.running_sequences()
        index, horizon = 0, None  # the first request still waiting; steps until the wider one's seats free
        while budget > 0:
            with self._cond:
                if index >= len(self._waiting):
                    return
                state = self._waiting[index]
            for choice, stop_reason in list(state.finish_requested.items()):  # choices the client ended meanwhile
                state.sequences[choice].finish("stop", stop_reason)
            if state.abort_requested or state.finished:  # the step loop ends it: no work, no blocks
                if self._take(state):
                    bisect.insort(self.running, state, key=self.order)
                continue
            if self.running and rows + len(state.sequences) > self.max_num_seqs:
                if horizon is None:
                    horizon = self._seats_free_within(len(state.sequences), rows)
                index += 1
                continue
            if horizon is not None and state.steps_left(self.prefill_chunk_tokens) > horizon:
                index += 1
                continue
            if self.admission_check is not None:
                admitted = self.admission_check(state)
                if admitted is None:
                    continue  # taken out of the queue: the next one is at the same index
                if not admitted:
                    index += 1
                    continue
            live = state.live_sequences()
            scheduled: list[Scheduled] = []
            for seq in live:
                self._prefix_hit(state, seq)
                count = self._chunk(seq, budget)
                if count <= 0 or not self._reserve(seq, count):
                    break
                scheduled.append(Scheduled(state, seq, count))
                budget -= count
            if not scheduled or not self._take(state):
                for seq in live:
                    self.release(seq)
                if not scheduled:
                    return  # the oldest waits for blocks or budget to free up
                continue  # it was aborted (taken out of the queue) meanwhile
            bisect.insort(self.running, state, key=self.order)
            if state.scheduled_at is None:
                state.scheduled_at = time.monotonic()
            rows += len(state.sequences)
            plan.extend(scheduled)

    def _seats_free_within(self, need: int, rows: int) -> float:
        """The steps after which ``need`` seats are surely free, the running requests ending no later
        than their :meth:`RequestState.steps_left` (all of them, for a request wider than the batch)."""
        if need > self.max_num_seqs:
            return max((state.steps_left(self.prefill_chunk_tokens) for state in self.running), default=0.0)
        ends = sorted(state.steps_left(self.prefill_chunk_tokens) for state in self.running for _ in state.unfinished())
        short = need - (self.max_num_seqs - rows)
        return ends[short - 1] if 0 < short <= len(ends) else 0.0

    def _take(self, state: RequestState) -> bool:
        """Take ``state`` out of the queue to run it; False when another thread removed it (an abort)."""
        with self._cond:
            for index, waiting in enumerate(self._waiting):
                if waiting is state:
                    self._waiting.pop(index)
                    return True
            return False
