"""The persistent batch: slots, add/remove events, device-side counts and noise, one host transfer."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.engine.sample import noise
from gyrfalcon.engine.sample.persistent_batch import PersistentBatch
from gyrfalcon.engine.sample.sampler import Sampler
from gyrfalcon.engine_api.types import EngineInfo, SamplingParams
from gyrfalcon.policies import logprobs, penalties, sampling
from gyrfalcon.policies import LogitsProcessor

V = 32
INFO = EngineInfo("m", V, 64, [2], 20, 8, frozenset())


class Seq:
    """What the batch reads of a sequence."""

    def __init__(self, params: SamplingParams, tokens=(), seed: int = 0) -> None:
        self.params, self.prompt_token_ids, self.token_ids, self.seed = params, [1, 2, 3], list(tokens), seed


class Recorder(LogitsProcessor):
    """Wants rows with frequency_penalty set; records the events it hears."""

    name = "recorder"

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def wants(self, params, extensions):
        return params.frequency_penalty != 0

    def add_row(self, slot, row):
        self.events.append(("add", slot))

    def remove_row(self, slot):
        self.events.append(("remove", slot))


def test_policies_hear_only_of_the_rows_that_want_them_and_slots_are_reused():
    recorder = Recorder()
    batch = PersistentBatch([recorder], [], V, "cpu")
    plain, asking, other = Seq(SamplingParams()), Seq(SamplingParams(frequency_penalty=1.0)), Seq(SamplingParams())
    rows = batch.rows([plain, asking], [{}, {}])
    assert rows.slot_list == [0, 1] and rows.slots.tolist() == [0, 1]
    assert recorder.events == [("add", 1)]
    assert rows.selected[id(recorder)] == [1]
    batch.rows([asking, plain], [{}, {}])  # the next step: no new events, same slots
    assert recorder.events == [("add", 1)]
    batch.leave(asking)
    assert recorder.events == [("add", 1), ("remove", 1)]
    assert batch.rows([other], [{}]).slot_list == [1]  # the freed slot is reused
    batch.leave(asking)  # leaving twice is harmless
    assert len(batch) == 2


def test_output_counts_follow_the_draws_and_are_rebuilt_when_a_sequence_rejoins():
    processor = penalties.FrequencyPenaltyProcessor()
    batch = PersistentBatch([processor], [], V, "cpu")
    seq = Seq(SamplingParams(frequency_penalty=0.5), tokens=[4, 4, 9])
    rows = batch.rows([seq], [{}])
    assert rows.output_counts[rows.slot_list[0], [4, 9]].tolist() == [2, 1]
    batch.record(rows, torch.tensor([9]))
    seq.token_ids.append(9)
    slot = rows.slot_list[0]
    assert batch.rows([seq], [{}]).output_counts[slot, [4, 9]].tolist() == [2, 2]
    batch.leave(seq)  # preempted: its tokens stay, its slot goes
    fresh = batch.rows([Seq(SamplingParams(frequency_penalty=0.5))], [{}])
    assert fresh.output_counts[fresh.slot_list[0]].sum() == 0  # the reused slot starts empty
    back = batch.rows([seq], [{}])
    assert back.output_counts[back.slot_list[0], [4, 9]].tolist() == [2, 2]


class Refuses(Recorder):
    """Records like :class:`Recorder`, and raises where told to."""

    def __init__(self, on_add=False, on_remove=False) -> None:
        super().__init__()
        self.on_add, self.on_remove = on_add, on_remove

    def add_row(self, slot, row):
        if self.on_add:
            raise RuntimeError("add_row failed")
        super().add_row(slot, row)

    def remove_row(self, slot):
        super().remove_row(slot)
        if self.on_remove:
            raise RuntimeError("remove_row failed")


def test_joining_is_all_or_nothing():
    good, bad = Recorder(), Refuses(on_add=True)
    batch = PersistentBatch([good, bad], [], V, "cpu")
    seq = Seq(SamplingParams(frequency_penalty=1.0))
    with pytest.raises(RuntimeError, match="add_row failed"):
        batch.rows([seq], [{}])
    assert good.events == [("add", 0), ("remove", 0)] and batch.slot(seq) is None and len(batch) == 0
    bad.on_add = False
    assert batch.rows([seq], [{}]).slot_list == [0]  # the slot went back; joining works again


def test_a_failing_remove_row_still_frees_the_slot(caplog):
    policy = Refuses(on_remove=True)
    batch = PersistentBatch([policy], [], V, "cpu")
    seq = Seq(SamplingParams(frequency_penalty=1.0))
    batch.rows([seq], [{}])
    batch.leave(seq)
    assert len(batch) == 0 and "remove_row" in caplog.text
    assert batch.rows([Seq(SamplingParams())], [{}]).slot_list == [0]


def test_counts_reach_every_slot_of_the_step():
    batch = PersistentBatch([penalties.PresencePenaltyProcessor()], [], V, "cpu")
    counted = Seq(SamplingParams(presence_penalty=1.0))
    plain = [Seq(SamplingParams()) for _ in range(12)]  # slots beyond the counts table's first rows
    rows = batch.rows([counted, *plain], [{}] * 13)
    batch.record(rows, torch.full((13,), 3))
    assert batch.rows([counted], [{}]).output_counts[0, 3] == 1


def _splitmix_reference(seed: int, position: int) -> float:
    mask = (1 << 64) - 1

    def mix(x: int) -> int:
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & mask
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    key = mix((seed + 0x9E3779B97F4A7C15) & mask)
    bits = mix((key + (position + 1) * 0x9E3779B97F4A7C15) & mask)
    return (bits >> 11) / 2.0**53


@pytest.mark.parametrize("seed", [0, 1, 7, 2**62 + 5, 2**64 - 1])
def test_device_uniforms_are_the_reference_hash_of_seed_and_position(seed):
    positions = list(range(5))
    seeds = torch.tensor([noise.as_int64(seed)] * 5, dtype=torch.long)
    got = noise.draw_uniforms(seeds, torch.tensor(positions)).tolist()
    assert got == [_splitmix_reference(seed, p) for p in positions]
    assert all(0.0 <= u < 1.0 for u in got) and len(set(got)) == 5


def test_uniforms_are_spread_evenly():
    u = noise.draw_uniforms(torch.arange(20000, dtype=torch.long), torch.zeros(20000, dtype=torch.long))
    histogram = torch.histc(u.float(), bins=10, min=0.0, max=1.0)
    assert (histogram - 2000).abs().max() < 200


def test_a_step_with_every_policy_makes_one_host_transfer(monkeypatch):
    """Temperature, truncation, penalties, bias, allow-list, top-k and explicit-id logprobs: the
    sampled ids, the tops and the logprobs reach the host in one copy."""
    processors = sampling.processors(INFO) + [
        p for p in penalties.processors(INFO) if p.name != "bad_words"
    ]
    sampler = Sampler(processors, logprobs.gatherers(INFO), [2], torch.Generator())
    batch = PersistentBatch(sampler.processors, sampler.gatherers, V, "cpu")
    params = [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.01, frequency_penalty=0.4, seed=3, logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.3, logit_bias={5: 2.0},
                       logprobs=1, logprob_token_ids=[3, 4]),  # fmt: skip
        SamplingParams(allowed_token_ids=[7, 8, 9], min_tokens=3, stop_token_ids=[8]),
    ]
    seqs = [Seq(p, tokens=[5, 6], seed=i) for i, p in enumerate(params)]
    rows = batch.rows(seqs, [{}] * 3)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    calls = {"tolist": 0, "item": 0}
    real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item

    def tolist(self):
        calls["tolist"] += 1
        return real_tolist(self)

    def item(self):
        calls["item"] += 1
        return real_item(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(torch.Tensor, "item", item)
    out = sampler.sample(logits.clone(), rows)
    monkeypatch.undo()
    assert calls == {"tolist": 1, "item": 0}
    assert out.errors == {} and out.token_ids[2] in (7, 9)
    raw = logits.log_softmax(dim=-1)
    first, second = out.token_ids[:2]
    top2 = raw[0].topk(2).indices.tolist()
    assert out.logprobs[0].token_ids == [first]
    assert out.logprobs[0].top_token_ids == [[first, *[t for t in top2 if t != first]]]
    assert out.logprobs[1].top_token_ids == [[second, *[t for t in (3, 4) if t != second]]]
    assert out.logprobs[1].top_logprobs[0] == pytest.approx(raw[1, out.logprobs[1].top_token_ids[0]].tolist())
    assert out.logprobs[2] is None


def test_min_tokens_bans_ride_with_the_step_and_ban_what_the_sampler_would():
    """Given the model's end-of-text ids, the batch stages the (row, id) pairs min_tokens bans at this
    draw (stop ids, and eos unless ignore_eos, until enough tokens were generated) with the rows'
    other values; the sampler then bans exactly those, as it does when it makes them itself."""
    sampler = Sampler([], [], [2], torch.Generator())
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[8]),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9], ignore_eos=True),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7]),
              SamplingParams(temperature=0.0)]  # fmt: skip
    seqs = [Seq(p, tokens=[5, 6], seed=i) for i, p in enumerate(params)]  # two generated: row 2 is done
    staged_batch = PersistentBatch([], [], V, "cpu", eos_token_ids=[2])
    staged = staged_batch.stage(seqs, [{}] * 4)
    rows = staged_batch.rows(seqs, [{}] * 4, staged)
    assert staged.bans == 3 and rows.min_tokens_bans.tolist() == [[0, 0, 1], [8, 2, 9]]
    logits = torch.zeros(4, V)
    logits[:, [2, 7, 8, 9]] = 5.0  # each row's best ids are the ones it may not draw yet
    own = PersistentBatch([], [], V, "cpu").rows(seqs, [{}] * 4)
    assert own.min_tokens_bans is None  # no end-of-text ids given: the sampler makes the bans itself
    assert sampler.sample(logits, rows).token_ids == sampler.sample(logits, own).token_ids == [7, 2, 2, 2]
    done = [Seq(p, tokens=[5, 6, 7, 8], seed=i) for i, p in enumerate(params[:2])]  # past min_tokens: staged, none
    assert staged_batch.rows(done, [{}] * 2).min_tokens_bans.shape == (2, 0)
