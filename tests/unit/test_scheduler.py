"""The admission policy: equal-length groups, sequence and padded-token limits, chunk budget, 503."""

from __future__ import annotations

import pytest

from gyrfalcon.engine.interface import OutputStream
from gyrfalcon.engine.outputs import RequestState
from gyrfalcon.engine.scheduler import Scheduler
from gyrfalcon.engine.types import EngineRequest, SamplingParams
from gyrfalcon.errors import RequestError


def state(name: str, length: int, n: int = 1) -> RequestState:
    request = EngineRequest(name, [5] * length, SamplingParams(n=n))
    return RequestState(request, OutputStream(name), [object()] * n)  # type: ignore[list-item]


def names(group):
    return [s.request_id for s in group]


def scheduler(**limits) -> Scheduler:
    values = dict(max_queue_len=8, max_num_seqs=8, max_num_batched_tokens=1000, prefill_chunk_tokens=64)
    values.update(limits)
    return Scheduler(**values)


def test_groups_equal_prompt_lengths_in_fifo_order():
    s = scheduler()
    for name, length in [("a", 10), ("b", 12), ("c", 10), ("d", 10)]:
        s.add(state(name, length))
    assert names(s.admit(0, 0)) == ["a", "c", "d"]  # b has another length: it waits for its own group
    assert names(s.admit(3, 10)) == ["b"]
    assert s.admit(4, 12) == [] and len(s) == 0


def test_max_num_seqs_counts_children():
    s = scheduler(max_num_seqs=4)
    s.add(state("a", 4, n=3))
    s.add(state("b", 4, n=2))
    assert names(s.admit(0, 0)) == ["a"]
    assert s.admit(3, 5) == []  # 3 + 2 > 4
    assert names(s.admit(2, 5)) == ["b"]


def test_padded_tokens_count_rows_times_longest():
    s = scheduler(max_num_batched_tokens=100)
    s.add(state("a", 30))
    assert s.admit(3, 20) == []  # 4 rows × 30 = 120 > 100
    assert names(s.admit(2, 20)) == ["a"]  # 3 × 30 = 90
    s.add(state("huge", 500))
    assert s.admit(1, 10) == []
    assert names(s.admit(0, 0)) == ["huge"]  # an empty batch always takes the oldest


def test_group_stays_within_one_prefill_chunk():
    s = scheduler(prefill_chunk_tokens=25)
    for name in "abc":
        s.add(state(name, 10))
    assert names(s.admit(0, 0)) == ["a", "b"]
    assert names(s.admit(2, 10)) == ["c"]


def test_full_queue_is_503_and_remove_frees_a_place():
    s = scheduler(max_queue_len=2)
    s.add(state("a", 3))
    s.add(state("b", 3))
    with pytest.raises(RequestError) as err:
        s.add(state("c", 3))
    assert err.value.status == 503 and err.value.headers == {"Retry-After": "1"}
    assert s.remove("a").request_id == "a" and s.remove("a") is None
    s.add(state("c", 3))
    assert names(s.drain()) == ["b", "c"]
