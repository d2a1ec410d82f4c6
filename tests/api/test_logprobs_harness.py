"""Evaluation-harness equivalence: loglikelihood scoring through the API equals an in-process model.

``test_loglikelihood_requests_like_the_harness`` always runs: it sends exactly what
lm-evaluation-harness's ``local-completions`` model sends for loglikelihood requests (token-id
prompts = context + continuation, ``echo``, ``logprobs: 1``, ``max_tokens: 1``, ``temperature: 0``)
and parses the answer with the harness's rule (sum of ``token_logprobs[ctxlen:-1]``, greedy when
each of those equals the best of its ``top_logprobs``), then compares with a direct forward pass.

``test_lm_eval_scores_through_the_server_equal_in_process`` (``slow``) runs the real harness when it
is installed (``pip install "lm_eval[api]==0.4.13"``): a local multiple-choice task over a JSONL
file, once as ``local-completions`` against this app served on a local port, once as ``hf``
in-process on the same folder; accuracy must be identical and every loglikelihood within 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import ServedInThread, served_app


COMPLETIONS = "/v1/completions"
PAIRS = [
    ("The capital of France is", " Paris"),
    ("One, two, three,", " four five"),
    ("The quick brown fox jumps over the", " lazy dog"),
    ("Hello", ", world!"),
]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True, dtype=torch.float32).eval()


@torch.inference_mode()
def reference(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The harness's in-process (``hf``) answer: summed continuation logprobs and greedy-ness."""
    logprobs = model(torch.tensor([context + continuation])).logits[0].float().log_softmax(dim=-1)
    rows = logprobs[len(context) - 1 : -1]
    target = torch.tensor(continuation)
    total = float(rows.gather(1, target.view(-1, 1)).sum())
    return total, bool((rows.argmax(dim=-1) == target).all())


def parse_like_the_harness(body: dict, ctxlens: list[int], drop_last: bool) -> list[tuple[float, bool]]:
    """lm-eval's ``LocalCompletionsAPI.parse_logprobs`` (``drop_last``: a generated token follows)."""
    out = []
    for choice, ctxlen in zip(sorted(body["choices"], key=lambda c: c["index"]), ctxlens):
        end = -1 if drop_last else None
        tokens = choice["logprobs"]["token_logprobs"][ctxlen:end]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:end]
        out.append((sum(tokens), all(tok == max(top.values()) for tok, top in zip(tokens, tops))))
    return out


def requests_for(tiny_engine, model) -> tuple[list[list[int]], list[int], list[list[int]]]:
    contexts = [tiny_engine.tokenize(c, add_special_tokens=False) for c, _ in PAIRS]
    continuations = [tiny_engine.tokenize(c + x, add_special_tokens=False)[len(ctx):] for (c, x), ctx in zip(PAIRS, contexts)]
    # one continuation that is the model's own greedy choice, so is_greedy is exercised both ways
    with torch.inference_mode():
        best = int(model(torch.tensor([contexts[0]])).logits[0, -1].argmax())
    contexts.append(contexts[0])
    continuations.append([best])
    return contexts, [len(c) for c in contexts], continuations


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_loglikelihood_requests_like_the_harness(client, tiny_engine, model, max_tokens):
    contexts, ctxlens, continuations = requests_for(tiny_engine, model)
    prompts = [ctx + cont for ctx, cont in zip(contexts, continuations)]
    r = client.simulate_post(COMPLETIONS, json={"model": "tiny", "prompt": prompts, "temperature": 0,
                                                "max_tokens": max_tokens, "logprobs": 1, "seed": 1234, "echo": True})  # fmt: skip
    assert r.status_code == 200, r.text
    got = parse_like_the_harness(r.json, ctxlens, drop_last=max_tokens == 1)
    expected = [reference(model, ctx, cont) for ctx, cont in zip(contexts, continuations)]
    assert [g for _, g in got] == [g for _, g in expected]
    assert expected[-1][1] is True and not all(g for _, g in expected)
    for (value, _), (want, _) in zip(got, expected):
        assert value == pytest.approx(want, abs=1e-4)


# ---------------------------------------------------------------------- the real harness (opt-in)

TASK = """task: gyrfalcon_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

ITEMS = [
    {"question": "The capital of France is", "choices": [" Paris", " London", " the moon"], "answer": 0},
    {"question": "One, two, three,", "choices": [" four", " seven", " blue"], "answer": 0},
    {"question": "The quick brown fox jumps over the", "choices": [" lazy dog", " river", " falcon"], "answer": 0},
    {"question": "The sky is", "choices": [" blue", " green", " Ishmael"], "answer": 0},
    {"question": "Hello, world! How are you", "choices": [" today?", " tomorrow?", "?"], "answer": 0},
]


@pytest.fixture
def served_url(app):
    """The app on a local port, for clients that speak HTTP."""
    with ServedInThread(app) as url:
        yield url


@pytest.mark.slow
def test_lm_eval_scores_through_the_server_equal_in_process(served_url, tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("tenacity", reason="lm_eval[api] is not installed")
    lm_eval = pytest.importorskip("lm_eval", reason="lm_eval is not installed")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "gyrfalcon_tiny_mc.yaml").write_text(TASK.format(data=data))
    tasks = TaskManager(include_path=str(tmp_path / "tasks"))
    common = dict(tasks=["gyrfalcon_tiny_mc"], task_manager=tasks, log_samples=True, batch_size=1)
    api = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model=tiny,base_url={served_url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={tiny_model_dir},num_concurrent=1,max_retries=1,tokenized_requests=True",
        **common,
    )
    hf = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={tiny_model_dir},dtype=float32,device=cpu", **common)
    got, want = api["results"]["gyrfalcon_tiny_mc"], hf["results"]["gyrfalcon_tiny_mc"]
    print("lm-eval through the server:", got, "\nlm-eval in-process (hf):", want)
    for metric in ("acc,none", "acc_norm,none"):
        assert got[metric] == want[metric], metric
    samples = zip(api["samples"]["gyrfalcon_tiny_mc"], hf["samples"]["gyrfalcon_tiny_mc"])
    for a, h in samples:
        for (value, greedy), (ref, ref_greedy) in zip([r[0] for r in a["resps"]], [r[0] for r in h["resps"]]):
            assert greedy == ref_greedy and value == pytest.approx(ref, abs=1e-4)


@pytest.mark.parametrize("kv_cache_dtype, tolerance", [("float32", 1e-4), ("auto", 1e-3)])
def test_an_int4_servers_loglikelihoods_equal_the_same_quantised_model_in_process(tiny_model_dir, kv_cache_dtype,
                                                                                  tolerance):  # fmt: skip
    """``--quantization int4`` (the tiny fp32 checkpoint quantised at load): what the harness reads
    through the API equals a direct forward of the same quantised model, as loaded in-process —
    within 1e-4 with the model's own (fp32) KV cache; the default beside int4 layers is an fp16
    cache (llama.cpp's for a GGUF), whose keys and values are rounded to 11 bits where the plain
    forward keeps fp32: within 1e-3 (1.3e-4 measured on these sums), the same greedy flags."""
    from gyrfalcon.models.loading import load_weights
    from gyrfalcon.plugins import plugin_manager
    from gyrfalcon.plugins.engines import create_transformers_engine
    from tests.conftest import tiny_settings
    from tests.helpers import api_client

    settings = tiny_settings(tiny_model_dir, quantization="int4", served_model_name=["tiny"], kv_cache_dtype=kv_cache_dtype)
    pm = plugin_manager()
    engine = create_transformers_engine(settings, pm)
    try:
        assert engine.wait_ready(60).ready and engine.info().quantization == "int4"
        expected_cache = torch.float16 if kv_cache_dtype == "auto" else torch.float32
        assert engine.core.runner.cache.keys[0].dtype == expected_cache
        quantised = load_weights(tiny_model_dir, "float32", "cpu", "int4")[0]
        contexts, ctxlens, continuations = requests_for(engine, quantised)
        prompts = [ctx + cont for ctx, cont in zip(contexts, continuations)]
        r = api_client(served_app(engine, settings, pm)).simulate_post(COMPLETIONS, json={
            "model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True})  # fmt: skip
        assert r.status_code == 200, r.text
        got = parse_like_the_harness(r.json, ctxlens, drop_last=True)
        expected = [reference(quantised, ctx, cont) for ctx, cont in zip(contexts, continuations)]
        assert [g for _, g in got] == [g for _, g in expected]
        for (value, _), (want, _) in zip(got, expected):
            assert value == pytest.approx(want, abs=tolerance)
    finally:
        engine.shutdown(grace=1.0)
