"""The scheduler: decode rows first, prefill chunks under the token budget, FIFO admission within
``max_num_seqs`` and free blocks, recompute preemption of the newest request, prefix-cache hits,
the 503 of a full queue."""

from __future__ import annotations

import pytest

from gyrfalcon.engine_api.interface import OutputStream
from gyrfalcon.engine.kv.blocks import BlockPool
from gyrfalcon.engine.request_state import RequestState, Sequence
from gyrfalcon.engine.scheduler import Scheduler
from gyrfalcon.engine_api.types import EngineRequest, SamplingParams
from gyrfalcon.engine_api.errors import QueueFull
from gyrfalcon.errors import Kind, RequestError


def state(name: str, length: int, n: int = 1, first: int = 5, salt: str | None = None, priority: int = 0) -> RequestState:
    params = SamplingParams(n=n, max_tokens=8)
    prompt = [first + i for i in range(length)]
    request = EngineRequest(name, prompt, params, cache_salt=salt, priority=priority)
    sequences = [Sequence(i, params, prompt, None, seed=i) for i in range(n)]  # type: ignore[arg-type]
    return RequestState(request, OutputStream(name), sequences)


def scheduler(blocks: int = 64, block_size: int = 4, prefix: bool = True, **limits) -> Scheduler:
    values = dict(max_queue_len=8, max_num_seqs=8, max_num_batched_tokens=1000, prefill_chunk_tokens=64)
    values.update(limits)
    return Scheduler(**values, pool=BlockPool(blocks, block_size, prefix))


def plan_of(s: Scheduler) -> list[tuple[str, int, int]]:
    """Schedule one step and play the forward: (request, choice, tokens fed) per item."""
    plan = s.schedule()
    for item in plan:
        item.seq.computed += item.count
        s.register_full_blocks(item.state, item.seq)
    return [(item.state.request_id, item.seq.index, item.count) for item in plan]


def generate(st: RequestState, token: int = 1) -> None:
    """What the engine does after a step reached a sequence's end: one new token per live choice."""
    for seq in st.sequences if not st.forked else st.live_sequences():
        seq.token_ids.append(token)
    st.forked = True


def test_decode_rows_go_first_then_chunks_under_the_budget_in_fifo_order():
    s = scheduler(max_num_batched_tokens=20, prefill_chunk_tokens=12)
    a, b, c = state("a", 6), state("b", 30, first=100), state("c", 5, first=200)
    for st in (a, b, c):
        s.add(st)
    # a chunk short of its prompt's end stops at a block boundary (blocks of 4 here): the 2 tokens
    # of budget left after b's chunk hold no block, so c waits rather than start with them
    assert plan_of(s) == [("a", 0, 6), ("b", 0, 12)] and len(s) == 1
    generate(a)
    assert plan_of(s) == [("a", 0, 1), ("b", 0, 12), ("c", 0, 5)]  # a decodes before any prefill
    generate(a)
    generate(c)
    assert plan_of(s) == [("a", 0, 1), ("c", 0, 1), ("b", 0, 6)]
    assert len(s) == 0 and [st.request_id for st in s.running] == ["a", "b", "c"]


def test_a_chunk_that_stops_short_of_the_prompt_ends_on_a_block_boundary():
    """Where the budget or the chunk size would cut a prompt inside a block, the chunk ends at the
    block before: the attention computes a prompt's rows in block-aligned groups, and a row then
    gets the same group however its prompt is chunked (alone, in a batch, after a cached prefix)."""
    s = scheduler(max_num_batched_tokens=10, prefill_chunk_tokens=7)
    s.add(state("a", 30))
    assert plan_of(s) == [("a", 0, 4)]  # 7 would end inside the second block of 4
    assert plan_of(s) == [("a", 0, 4)]
    assert all(seq.computed % 4 == 0 for seq in s.running[0].sequences)


def test_max_num_seqs_counts_every_child_of_a_request():
    s = scheduler(max_num_seqs=4)
    s.add(state("a", 3, n=3))
    s.add(state("b", 3, n=2, first=50))
    assert plan_of(s) == [("a", 0, 3)]  # one prefill for three choices; b (2 more) waits
    assert s.running_sequences() == 3 and len(s) == 1


def test_a_request_waits_for_blocks_and_the_newest_is_preempted_whole_when_they_run_out():
    s = scheduler(blocks=7, block_size=4)  # 6 usable blocks of 4 tokens
    s.add(state("a", 8))  # 2 blocks
    s.add(state("b", 8, first=50, n=2))  # 2 blocks for the prompt
    s.add(state("c", 12, first=90))  # 3 blocks: only 2 left
    assert plan_of(s) == [("a", 0, 8), ("b", 0, 8)]
    assert s.pool.num_free == 2 and len(s) == 1
    generate(s.running[0])
    b = s.running[1]
    generate(b)
    b.sequences[1].blocks = [s.pool.share(x) for x in b.sequences[0].blocks]  # what the engine's fork does
    b.sequences[1].computed = 8
    # a needs a third block (position 8), b's two children one each: 3 > 2 free -> b is preempted whole
    assert plan_of(s) == [("a", 0, 1)]
    assert s.preemptions == 1 and [st.request_id for st in s.running] == ["a"]
    assert all(not seq.blocks and seq.computed == 0 for seq in b.sequences)
    assert s.drain()[0] is b  # back at the head of the queue, its tokens kept
    assert [len(seq.token_ids) for seq in b.sequences] == [1, 1]


def test_prefix_cache_hits_count_as_computed_and_salt_isolates():
    s = scheduler(block_size=4)
    s.add(state("a", 10))
    assert plan_of(s) == [("a", 0, 10)]
    s.finish_request(s.running[0])
    s.add(state("b", 10))  # same prompt: blocks 0 and 1 (8 tokens) are found
    assert plan_of(s) == [("b", 0, 2)]
    assert s.pool.hits == 2
    s.add(state("c", 10, salt="tenant-2"))  # another salt: nothing found
    assert plan_of(s) == [("c", 0, 10)]
    s.add(state("d", 8))  # 8 tokens: block 1 holds the last token, which is always computed
    assert plan_of(s) == [("d", 0, 4)]
    assert s.pool.hits == 3


def test_a_request_that_could_never_fit_is_refused_at_submit():
    s = scheduler(blocks=5, block_size=4)  # 16 tokens
    s.check_fits(8, 8, 1)
    with pytest.raises(RequestError) as err:
        s.check_fits(8, 8, 2)
    assert err.value.param == "max_tokens" and err.value.type == Kind.INVALID
    with pytest.raises(RequestError) as err:
        s.check_fits(20, 1, 1)
    assert err.value.param == "prompt"


def test_full_queue_is_503_and_remove_frees_a_place():
    """max_queue_len requests may wait beyond those the free seats take at the next step (requests
    sent at once reach the queue before any is admitted: with 2 seats and a queue of 2, the 4th of
    4 sent at once was refused)."""
    s = scheduler(max_queue_len=2, max_num_seqs=1)
    s.add(state("a", 3))  # takes the free seat at the next step
    s.add(state("b", 3))
    s.add(state("c", 3))
    with pytest.raises(QueueFull) as err:
        s.add(state("d", 3))
    assert err.value.retry_after == 1
    assert s.remove("a").request_id == "a" and s.remove("a") is None
    s.add(state("d", 3))
    with pytest.raises(QueueFull):
        s.add(state("e", 3, n=2))  # two choices need two seats: it would wait with two before it
    assert [st.request_id for st in s.drain()] == ["b", "c", "d"]


def test_an_abort_while_the_head_is_being_admitted_loses_no_request_and_no_block():
    """The HTTP thread takes the head out of the queue (an abort) after the step loop read it and
    before it popped it: the loop must not pop the next request in its place."""
    s = scheduler(blocks=16, block_size=4)
    a, b = state("a", 6), state("b", 5, first=40)
    s.add(a)
    s.add(b)
    looked_up = s._prefix_hit

    def abort_meanwhile(st, seq):
        if st is a:
            assert s.remove("a") is a
        looked_up(st, seq)

    s._prefix_hit = abort_meanwhile
    assert plan_of(s) == [("b", 0, 5)]
    assert s.running == [b] and len(s) == 0
    assert s.pool.num_free == s.pool.usable_blocks - 2  # only b's blocks are held


def test_a_request_waiting_for_seats_is_passed_only_by_requests_that_end_before_its_seats_free():
    """Fair admission: a request wider than the free seats does not freeze the queue behind it. A
    narrower request that fits the idle seats and surely ends (prefill and max_tokens, in steps)
    before the wide one's seats are surely free passes it; a longer one waits behind it, so the
    wide one starts no later than it would have alone at the head."""

    def sized(name: str, n: int, max_tokens: int) -> RequestState:
        st = state(name, 3, n=n, first=10 * len(name) + n)
        st.request.sampling.max_tokens = max_tokens
        return st

    s = scheduler(max_num_seqs=4)
    running = sized("a", 2, 8)
    s.add(running)
    assert plan_of(s) == [("a", 0, 3)]
    generate(running)  # both choices running: 2 of 4 seats, each with 7 tokens to go
    wide, short, long = sized("wide", 3, 8), sized("short", 1, 5), sized("long", 1, 20)
    for st in (wide, long, short):
        s.add(st)
    plan = plan_of(s)
    assert ("short", 0, 3) in plan and not any(name in ("wide", "long") for name, _, _ in plan)
    assert s.running == [running, short] and [st.request_id for st in s.drain()] == ["wide", "long"]

    s = scheduler(max_num_seqs=4)  # wider than the batch: it waits for the whole batch to end
    s.add(running := sized("a", 1, 8))
    plan_of(s)
    generate(running)
    for st in (sized("widest", 6, 4), sized("b", 1, 9), sized("c", 1, 6)):
        s.add(st)
    assert [name for name, _, _ in plan_of(s)] == ["a", "c"]


def test_a_waiting_request_whose_choices_the_client_finished_is_not_recomputed():
    s = scheduler(block_size=4)
    st = state("a", 6, n=2)
    generate(st)
    st.finish_requested.update({0: "x", 1: "y"})  # both choices hit stop strings while it waited
    s.add(st)
    assert plan_of(s) == [] and s.running == [st]  # admitted with no work: the step loop ends it
    assert [seq.finish_reason for seq in st.sequences] == ["stop", "stop"] and s.pool.num_free == s.pool.usable_blocks


def test_priority_policy_admits_lower_priority_first_and_preempts_the_highest_value_last():
    s = scheduler(blocks=7, block_size=4, max_num_seqs=2, policy="priority")  # 6 usable blocks
    for name, priority in (("low", 5), ("mid", 0), ("urgent", -3), ("mid2", 0)):
        s.add(state(name, 8, first=10 * len(name), priority=priority))
    assert plan_of(s) == [("urgent", 0, 8), ("mid", 0, 8)]  # two rows: by priority, then arrival
    assert [st.request_id for st in s.running] == ["urgent", "mid"]
    for st in list(s.running):
        generate(st)
    plan_of(s)
    # running out of blocks preempts the request with the highest priority value (mid, not urgent)
    for st in s.running:
        st.sequences[0].token_ids.extend([1] * 5)
    plan_of(s)
    assert [st.request_id for st in s.running] == ["urgent"]
    assert s.preemptions == 1
    waiting = s.drain()
    assert [st.request_id for st in waiting] == ["mid", "mid2", "low"]  # mid back before mid2


def test_fcfs_policy_ignores_priority_and_keeps_arrival_order():
    s = scheduler(max_num_seqs=1)
    s.add(state("first", 4, priority=9))
    s.add(state("second", 4, first=50, priority=-9))
    assert plan_of(s) == [("first", 0, 4)]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling policy"):
        scheduler(policy="lifo")
