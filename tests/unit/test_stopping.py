"""Stop rules, stop strings and incremental detokenisation on the tiny model's real tokenizer."""

from __future__ import annotations

import pytest

from gyrfalcon.client.choice import ChoiceText, IncrementalDetokenizer, StopStrings
from gyrfalcon.engine.request_state import StopChecker
from gyrfalcon.engine_api.types import CompletionOutput
from gyrfalcon.engine_api.types import SamplingParams

EOS = 2
PROMPT = [1, 87, 85, 264, 201]  # "<|im_start|>user\n" in the tiny tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


class FedChoice(ChoiceText):
    """A client choice fed one token at a time as the core reports it: the core's token-id stop
    rules (eos, stop ids, length) decide the finish it sends with the token."""

    def __init__(self, index, params, detokenizer, core_rules: StopChecker):
        super().__init__(index, params, detokenizer)
        self.core_rules = core_rules

    def append(self, token_id, logprobs=None):
        count = len(self.token_ids) + 1
        stop = self.core_rules.check_token(token_id, count)
        reason, stop_reason = stop if stop else (("length", None) if self.core_rules.check_length(count) else (None, None))
        self.add(CompletionOutput(self.index, "", [token_id], logprobs, reason, stop_reason))


def make_sequence(tokenizer, max_model_len: int = 128, prompt=PROMPT, **kw) -> FedChoice:
    params = SamplingParams(**{"max_tokens": 64, **kw})
    detok = IncrementalDetokenizer(tokenizer, prompt, frozenset(tokenizer.all_special_ids),
                                   params.skip_special_tokens, params.spaces_between_special_tokens)  # fmt: skip
    stopper = StopChecker(params, [EOS], len(prompt), max_model_len)
    return FedChoice(0, params, detok, stopper)


def feed(seq: FedChoice, ids: list[int]) -> list[str]:
    """Append tokens until the sequence finishes; return the visible text after each token."""
    seen = []
    for token_id in ids:
        seq.append(token_id)
        seen.append(seq.visible_text())
        if seq.finished:
            break
    return seen


# ------------------------------------------------------------------ detokenizer


@pytest.mark.parametrize("text", ["Hello world, the capital of France is Paris.", "café 😀 ok", "one two three"])
def test_incremental_deltas_join_to_the_full_decode_without_broken_utf8(tokenizer, text):
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, PROMPT, frozenset(tokenizer.all_special_ids))
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = encode(tokenizer, "one") + [EOS, 1] + encode(tokenizer, " two")
    specials = frozenset(tokenizer.all_special_ids)

    def run(**kw):
        detok = IncrementalDetokenizer(tokenizer, PROMPT, specials, **kw)
        return "".join(detok.add(t) for t in ids) + detok.flush()

    assert run(skip_special_tokens=True) == "one two"
    assert run(skip_special_tokens=False, spaces_between_special_tokens=False) == "one<|im_end|><|im_start|> two"
    assert run(skip_special_tokens=False, spaces_between_special_tokens=True) == "one <|im_end|> <|im_start|>  two"


# ------------------------------------------------------------------ stop rules


def test_stop_string_cuts_the_text_before_it(tokenizer):
    seq = make_sequence(tokenizer, stop=[" capital"])
    feed(seq, encode(tokenizer, "Hello world, the capital of France"))
    assert (seq.finish_reason, seq.stop_reason, seq.text) == ("stop", " capital", "Hello world, the")
    assert len(seq.token_ids) == 7  # tokens are kept up to the one completing the stop string


def test_stop_string_included_on_request(tokenizer):
    seq = make_sequence(tokenizer, stop=[" capital"], include_stop_str_in_output=True)
    feed(seq, encode(tokenizer, "Hello world, the capital of France"))
    assert (seq.finish_reason, seq.text) == ("stop", "Hello world, the capital")


def test_stop_string_split_across_tokens_and_inside_a_token(tokenizer):
    # "lo wo" spans the tokens "lo" and " world"; the text after it within " world" is cut too
    seq = make_sequence(tokenizer, stop=["lo wo"])
    feed(seq, encode(tokenizer, "Hello world, the"))
    assert (seq.stop_reason, seq.text, len(seq.token_ids)) == ("lo wo", "Hel", 4)
    seq = make_sequence(tokenizer, stop=["apit"])
    feed(seq, encode(tokenizer, "the capital of"))
    assert (seq.stop_reason, seq.text) == ("apit", "the c")


def test_earliest_stop_string_wins(tokenizer):
    seq = make_sequence(tokenizer, stop=["France", "of"])
    feed(seq, encode(tokenizer, "the capital of France is"))
    assert (seq.stop_reason, seq.text) == ("of", "the capital ")


def test_possible_stop_string_start_is_held_back(tokenizer):
    seq = make_sequence(tokenizer, stop=["lo wo"])
    visible = feed(seq, encode(tokenizer, "Hello world"))
    # "Hel": its "l" could start "lo wo"; "Hello": "lo" could; then " world" completes it
    assert visible == ["H", "He", "Hel", "Hel"]
    assert seq.finished and seq.text == "Hel"
    seq = make_sequence(tokenizer, stop=["lo wo"])
    visible = feed(seq, encode(tokenizer, "Hello there"))
    assert visible[-1] == "Hello there" and not seq.finished  # "lo t" cannot start it any more


def test_stop_strings_only_after_min_tokens(tokenizer):
    seq = make_sequence(tokenizer, stop=["el"], min_tokens=3)
    feed(seq, encode(tokenizer, "Hello world, the capital"))
    assert not seq.finished or seq.stop_reason != "el"
    seq = make_sequence(tokenizer, stop=[" the"], min_tokens=3)
    feed(seq, encode(tokenizer, "Hello world, the capital"))
    assert (seq.stop_reason, seq.text) == (" the", "Hello world,")


def test_stop_token_id(tokenizer):
    ids = encode(tokenizer, "one two three")
    seq = make_sequence(tokenizer, stop_token_ids=[ids[2]])
    feed(seq, ids)
    assert (seq.finish_reason, seq.stop_reason, seq.token_ids, seq.text) == ("stop", ids[2], ids[:3], "one")
    seq = make_sequence(tokenizer, stop_token_ids=[ids[2]], include_stop_str_in_output=True)
    feed(seq, ids)
    assert seq.text == "one two"


def test_eos_stops_without_stop_reason(tokenizer):
    seq = make_sequence(tokenizer)
    feed(seq, encode(tokenizer, "one") + [EOS, 5])
    assert (seq.finish_reason, seq.stop_reason, seq.text) == ("stop", None, "one")
    assert seq.token_ids[-1] == EOS


def test_ignore_eos_keeps_going(tokenizer):
    seq = make_sequence(tokenizer, ignore_eos=True, max_tokens=4)
    feed(seq, encode(tokenizer, "one") + [EOS, EOS, EOS])
    assert (seq.finish_reason, len(seq.token_ids)) == ("length", 4)


def test_min_tokens_defers_eos_and_stop_token_ids(tokenizer):
    seq = make_sequence(tokenizer, min_tokens=3, stop_token_ids=[71])
    feed(seq, [EOS, 71, 275, EOS])
    assert (seq.finish_reason, len(seq.token_ids)) == ("stop", 4)


def test_max_tokens_is_length(tokenizer):
    seq = make_sequence(tokenizer, max_tokens=3)
    feed(seq, encode(tokenizer, "Hello world, the capital"))
    assert (seq.finish_reason, seq.stop_reason, len(seq.token_ids)) == ("length", None, 3)


def test_context_end_is_length(tokenizer):
    seq = make_sequence(tokenizer, max_model_len=len(PROMPT) + 2, max_tokens=50)
    feed(seq, encode(tokenizer, "Hello world, the capital"))
    assert (seq.finish_reason, len(seq.token_ids)) == ("length", 2)


def test_holdback_is_the_longest_possible_stop_prefix():
    checker = StopStrings(SamplingParams(stop=["abc", "xbz"]))
    assert checker.holdback("zzab") == 2
    assert checker.holdback("zzx") == 1
    assert checker.holdback("zzxb") == 2
    assert checker.holdback("zz") == 0
    included = StopStrings(SamplingParams(stop=["abc"], include_stop_str_in_output=True))
    assert included.holdback("zzab") == 0


def _brute_holdback(stops, text):
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


def test_incremental_stop_matching_equals_a_brute_force_search():
    """The automata fed chunk by chunk find the earliest-starting stop string ending in each chunk
    and hold back exactly the longest stop-string prefix ending the text (on random texts)."""
    import random

    rng = random.Random(3)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        checker = StopStrings(SamplingParams(stop=stops))
        text = ""
        while len(text) < 40:
            chunk = "".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
            before, text = len(text), text + chunk
            found = checker.check_text(text, 1)
            window = max(0, before - max(map(len, stops)) + 1)
            hits = [(text.find(s, window), s) for s in stops]
            hits = [(p, s) for p, s in hits if p >= 0 and p + len(s) > before]
            if hits:
                position, stop = min(hits)
                assert found == (stop, position), (stops, text)
                break
            assert found is None, (stops, text)
            assert checker.held() == _brute_holdback(stops, text) == checker.holdback(text)


def test_bytes_that_never_form_a_character_are_released_and_the_window_stays_small(tokenizer):
    """Byte tokens of an invalid UTF-8 sequence (lone continuation bytes) never complete a
    character: they are released as U+FFFD after a few tokens instead of being held (and
    re-decoded) for ever."""
    continuation = [t for t in range(tokenizer.vocab_size)
                    if tokenizer.convert_ids_to_tokens(t) in ("\\x80", "Ģ")]  # byte 0x80 in byte-level BPE
    token = continuation[0]
    detok = IncrementalDetokenizer(tokenizer, PROMPT, frozenset(tokenizer.all_special_ids))
    released = [detok.add(token) for _ in range(40)]
    assert sum(len(r) for r in released) > 0 and "\ufffd" in "".join(released)
    assert len(detok._ids) - detok._prefix <= 2 * 7  # bounded window, whatever the number of tokens
