"""The transformers engine end to end on the tiny model."""

from __future__ import annotations

import time

import pytest
import torch

from gyrfalcon import hookimpl
from gyrfalcon.plugins.engines import create_transformers_engine
from gyrfalcon.engine_api.types import EngineRequest, OutputKind, SamplingParams
from gyrfalcon.engine_api.errors import QueueFull, ShuttingDown
from gyrfalcon.errors import Kind, RequestError
from gyrfalcon.plugins import plugin_manager
from gyrfalcon.policies import LogprobGatherer
from gyrfalcon.validation import RequestValidator
from tests.conftest import tiny_settings

PROMPT = [1, 87, 85, 264, 201, 42, 302, 432, 381, 2, 201, 1, 280, 85, 509, 86, 201]
_ids = iter(range(10**9))


def request(prompt=PROMPT, kind=OutputKind.FINAL_ONLY, **params) -> EngineRequest:
    return EngineRequest(f"test-{next(_ids)}", list(prompt), SamplingParams(**params), kind)


def final(engine, **params):
    outputs = list(engine.submit(request(**params)))
    assert len(outputs) == 1 and outputs[0].finished
    return outputs[0]


def test_info_and_capabilities(tiny_engine):
    info = tiny_engine.info()
    assert (info.vocab_size, info.max_model_len, info.eos_token_ids, info.max_num_seqs) == (512, 128, [2], 8)
    assert info.capabilities == {
        "n", "max_tokens", "min_tokens", "seed", "stop", "stop_token_ids", "ignore_eos",
        "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "cache_salt", "detokenize",
        "temperature", "top_k", "top_p", "min_p",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids",
        "bad_words",  # gyrfalcon.plugins.penalties
        "logprobs", "prompt_logprobs", "logprob_token_ids",  # gyrfalcon.plugins.logprobs
        "structured_outputs",  # gyrfalcon.plugins.structured_outputs
    }  # fmt: skip
    assert tiny_engine.health().ready


def test_max_model_len_is_capped_by_the_model(tiny_model_dir):
    engine = create_transformers_engine(tiny_settings(tiny_model_dir, max_model_len=10_000), start=False)
    assert engine.info().max_model_len == 256
    assert engine.health().ready is False and engine.health().message == "loading model"
    engine.shutdown(0)


def test_greedy_equals_argmax_of_a_direct_forward_pass(tiny_engine, tiny_model_dir):
    from gyrfalcon.models import load_model_and_tokenizer

    out = final(tiny_engine, temperature=0.0, max_tokens=6, ignore_eos=True)
    model, _ = load_model_and_tokenizer(tiny_model_dir, "float32", "cpu")
    ids = list(PROMPT)
    with torch.inference_mode():
        for _ in range(6):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    assert out.outputs[0].token_ids == ids[len(PROMPT):]
    assert out.outputs[0].text == tiny_engine.detokenize(ids[len(PROMPT):], skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_and_independent_of_the_other_choices(tiny_engine):
    params = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = final(tiny_engine, seed=5, **params).outputs[0].token_ids
    again = final(tiny_engine, seed=5, **params).outputs[0].token_ids
    assert alone == again
    plain_three = final(tiny_engine, seed=5, n=3, **params)
    assert plain_three.outputs[0].token_ids == alone
    assert plain_three.outputs[1].token_ids == final(tiny_engine, seed=6, **params).outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in plain_three.outputs}) == 3
    # the same holds with a truncation processor in the batch
    top_k_alone = final(tiny_engine, seed=5, top_k=50, **params).outputs[0].token_ids
    assert final(tiny_engine, seed=5, n=3, top_k=50, **params).outputs[0].token_ids == top_k_alone


def test_n8_end_to_end(tiny_engine):
    out = final(tiny_engine, n=8, temperature=1.0, max_tokens=10, ignore_eos=True)
    assert [c.index for c in out.outputs] == list(range(8))
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in out.outputs)
    assert out.num_generated_tokens == 80
    finishes: dict[int, list[str]] = {}
    texts: dict[int, str] = {}
    for item in tiny_engine.submit(request(kind=OutputKind.DELTA, n=8, temperature=1.0, max_tokens=10, seed=1)):
        for choice in item.outputs:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert sorted(finishes) == list(range(8)) and all(len(f) == 1 for f in finishes.values())
    again = final(tiny_engine, n=8, temperature=1.0, max_tokens=10, seed=1)
    assert [texts[i] for i in range(8)] == [c.text for c in again.outputs]


def greedy_tokens(engine, count=12):
    return final(engine, temperature=0.0, max_tokens=count, ignore_eos=True).outputs[0].token_ids


def test_stop_token_ids_end_to_end(tiny_engine):
    tokens = greedy_tokens(tiny_engine)
    target = tokens[3]
    out = final(tiny_engine, temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[target]).outputs[0]
    cut = tokens.index(target) + 1
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", target, tokens[:cut])


def test_min_tokens_end_to_end(tiny_engine):
    tokens = greedy_tokens(tiny_engine)
    out = final(tiny_engine, temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[tokens[0]],
                min_tokens=3).outputs[0]  # fmt: skip
    assert tokens[0] not in out.token_ids[:3]
    assert len(out.token_ids) >= 3


def test_stop_string_end_to_end(tiny_engine):
    out = final(tiny_engine, temperature=0.0, max_tokens=12, ignore_eos=True).outputs[0]
    text = out.text
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stopped = final(tiny_engine, temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]).outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason, stopped.text) == ("stop", stop, text[: text.find(stop)])
    included = final(tiny_engine, temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop],
                     include_stop_str_in_output=True).outputs[0]  # fmt: skip
    assert included.text == text[: text.find(stop) + len(stop)]


def test_length_at_max_tokens_and_at_context_end(tiny_engine):
    out = final(tiny_engine, prompt=[5] * 120, temperature=0.0, max_tokens=8, ignore_eos=True).outputs[0]
    assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == ("length", None, 8)


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([], {}, "prompt"),
        ([1, 512], {}, "prompt"),
        ([1, -1], {}, "prompt"),
        ([5] * 120, {"max_tokens": 9}, "max_tokens"),
        ([5] * 128, {"max_tokens": 1}, "prompt"),
        (PROMPT, {"max_tokens": 0}, "max_tokens"),
        (PROMPT, {"n": 1025}, "n"),  # above max_request_seqs (max_num_seqs only bounds the batch)
        (PROMPT, {"n": 0}, "n"),
        (PROMPT, {"min_tokens": 17}, "min_tokens"),
        (PROMPT, {"logprobs": 21}, "logprobs"),  # above max_logprobs (20)
        (PROMPT, {"presence_penalty": 2.5}, "presence_penalty"),
        (PROMPT, {"logit_bias": {512: 1.0}}, "logit_bias"),
        (PROMPT, {"allowed_token_ids": []}, "allowed_token_ids"),
        (PROMPT, {"bad_words": [""]}, "bad_words.0"),
        (PROMPT, {"top_p": 0.0}, "top_p"),
        (PROMPT, {"top_k": -5}, "top_k"),
        (PROMPT, {"stop": ["x", ""]}, "stop.1"),
        (PROMPT, {"stop": ["x" * 1025]}, "stop.0"),  # the documents' maxLength of a stop string
        (PROMPT, {"bad_words": ["ok", 7]}, "bad_words.1"),
        (PROMPT, {"stop_token_ids": [600]}, "stop_token_ids"),
    ],
)
def test_the_validator_refuses_naming_the_param(tiny_engine, prompt, params, param):
    validator = RequestValidator.of(plugin_manager(), tiny_engine.info())
    with pytest.raises(RequestError) as err:
        validator.check(request(prompt=prompt, **params))
    assert (err.value.type, err.value.param) == (Kind.INVALID, param)


def test_the_bounds_a_request_met_on_the_wire_are_not_decided_again(tiny_engine):
    """The translator's requests had their fields' bounds decided on the wire (the documents' and
    the deployment's): the validator leaves them, and decides only what the wire cannot."""
    validator = RequestValidator.of(plugin_manager(), tiny_engine.info())
    beyond_bounds = request(prompt=PROMPT, n=1025, logprobs=21, top_p=0.0, stop_token_ids=[600])
    with pytest.raises(RequestError):
        validator.check(beyond_bounds)
    validator.check(beyond_bounds, bounds_decided=True)
    with pytest.raises(RequestError) as err:
        validator.check(request(prompt=[5] * 120, max_tokens=9), bounds_decided=True)
    assert err.value.param == "max_tokens"


def test_unknown_extension_is_rejected(tiny_engine):
    req = request()
    req.extensions = {"mystery": 1}
    with pytest.raises(RequestError) as err:
        RequestValidator.of(plugin_manager(), tiny_engine.info()).check(req)
    assert (err.value.type, err.value.param) == (Kind.INVALID, "extensions.mystery")


def test_submit_refuses_only_what_the_kv_cache_can_never_hold(tiny_engine):
    """The engine trusts a validated request: a prompt past the context is the validator's to
    refuse, while a request wider than the whole KV cache is refused by the engine alone."""
    with pytest.raises(RequestError) as err:
        tiny_engine.submit(request(prompt=PROMPT, n=4096, max_tokens=100))
    assert err.value.param == "max_tokens" and "KV cache" in err.value.message
    with pytest.raises(RequestError) as err:
        RequestValidator.of(plugin_manager(), tiny_engine.info()).check(request(prompt=[5] * 128, max_tokens=1))
    assert err.value.param == "prompt"


def test_queue_full_is_503_with_retry_after(tiny_model_dir):
    engine = create_transformers_engine(tiny_settings(tiny_model_dir, max_queue_len=2, max_num_seqs=1), start=False)
    streams = [engine.submit(request()) for _ in range(3)]  # one about to take the free seat, two queued
    with pytest.raises(QueueFull) as err:
        engine.submit(request())
    assert err.value.retry_after == 1
    assert engine.stats()["waiting"] == 3
    engine.shutdown(0)
    for stream in streams:
        (last,) = list(stream)
        assert last.finished and last.outputs[0].finish_reason == "abort"
    with pytest.raises(ShuttingDown):
        engine.submit(request())


def test_requests_within_the_stated_capacity_are_never_refused(tiny_model_dir):
    """max_num_seqs + max_queue_len requests sent at once, then one more right after their
    answers: none is refused (they reached the queue before the engine admitted any, and the
    queue was counted full at max_queue_len)."""
    import threading

    engine = create_transformers_engine(tiny_settings(tiny_model_dir, max_queue_len=2, max_num_seqs=2))
    assert engine.wait_ready(60).ready
    refused = []

    def ask(name):
        try:
            list(engine.submit(EngineRequest(name, [1, 2, 3], SamplingParams(temperature=0, max_tokens=3))))
        except QueueFull as exc:
            refused.append((name, exc))

    try:
        for trial in range(10):
            threads = [threading.Thread(target=ask, args=(f"t{trial}-{i}",)) for i in range(4)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            ask(f"t{trial}-after")
    finally:
        engine.shutdown(1.0)
    assert refused == []


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_closing_the_stream_aborts_and_frees_the_request(tiny_engine):
    before = tiny_engine.stats()["requests_aborted"]
    stream = tiny_engine.submit(request(kind=OutputKind.DELTA, n=2, temperature=1.0, max_tokens=100, ignore_eos=True))
    first = next(stream)
    assert not first.finished
    stream.close()
    assert list(stream) == []
    wait_for(lambda: stream.request_id not in tiny_engine.core._live)
    assert tiny_engine.stats()["requests_aborted"] == before + 1
    tiny_engine.abort(stream.request_id)  # idempotent
    tiny_engine.abort("no-such-request")


def test_abort_reports_abort_on_every_running_choice(tiny_engine):
    stream = tiny_engine.submit(request(kind=OutputKind.DELTA, n=2, temperature=1.0, max_tokens=100, ignore_eos=True))
    next(stream)
    tiny_engine.abort(stream.request_id)
    rest = list(stream)
    assert rest[-1].finished
    reasons = {c.index: c.finish_reason for item in rest for c in item.outputs if c.finish_reason}
    assert reasons == {0: "abort", 1: "abort"}
    stats = tiny_engine.stats()
    assert {"running", "waiting", "requests_finished", "generation_tokens"} <= set(stats)
    wait_for(lambda: tiny_engine.stats()["running"] == 0)


def test_text_helpers(tiny_engine):
    ids = tiny_engine.tokenize("Hello world", add_special_tokens=True)
    assert ids == tiny_engine.tokenize("Hello world", add_special_tokens=False)  # no BOS is added
    assert tiny_engine.detokenize(ids) == "Hello world"
    assert "".join(tiny_engine.token_strings(ids)) == "Hello world"
    text = tiny_engine.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_engine.tokenize(text, add_special_tokens=False)[0] == 1
    assert tiny_engine.detokenize([2, 42], skip_special_tokens=True) == "H"


class TopTwoGatherer(LogprobGatherer):
    name = "top_two"
    fields = frozenset({"logprobs"})

    def wants(self, params, extensions):
        return params.logprobs is not None

    def gather(self, logprobs, sampled, rows, selected):
        out = [None] * len(rows)
        for i in selected:
            top = logprobs[i].topk(2)
            out[i] = (top.indices.tolist(), top.values.tolist())
        return out


class GathererPlugin:
    @hookimpl
    def gyrfalcon_logprob_gatherers(self, info):
        return [TopTwoGatherer()]


def test_engine_hooks_resolved_from_the_given_plugin_manager(tiny_model_dir):
    from gyrfalcon.plugins import plugin_manager
    from gyrfalcon.plugins.engines import create_transformers_engine

    pm = plugin_manager()
    pm.register(GathererPlugin(), name="test-gatherer")
    engine = create_transformers_engine(tiny_settings(tiny_model_dir), pm=pm)
    try:
        assert "logprobs" in engine.info().capabilities
        assert engine.wait_ready(60).ready
        out = final(engine, n=2, temperature=1.0, max_tokens=4, logprobs=2, seed=3).outputs
        for choice in out:
            assert choice.logprobs.token_ids == choice.token_ids
            assert len(choice.logprobs.top_token_ids) == 4 and all(len(t) == 2 for t in choice.logprobs.top_token_ids)
        assert final(engine, max_tokens=2).outputs[0].logprobs is None
    finally:
        engine.shutdown(0)


def test_load_failure_is_reported_by_health_and_in_band(tiny_model_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").unlink()
    engine = create_transformers_engine(tiny_settings(str(broken)), start=False)
    stream = engine.submit(request())
    engine.core.start()
    (last,) = list(stream)
    assert last.finished and last.error is not None and "failed to load" in last.error.message
    health = engine.wait_ready(10)
    assert not health.ready and health.message.startswith("model failed to load")
    with pytest.raises(ShuttingDown) as err:
        engine.submit(request())
    assert err.value.message.startswith("model failed to load")
    engine.shutdown(0)
