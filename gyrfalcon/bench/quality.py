"""``python -m gyrfalcon.bench.quality``: how far each ``--quantization`` moves the model from its fp32 reference.

For the default model (or ``--model DIR``): over a fixed English paragraph (the opening of Darwin's
*On the Origin of Species*, starting with the tokenizer's BOS where it has one), the mean
``|Δ log p|`` over the full vocabulary at every position and the top-1 agreement against the fp32
model without quantisation; then greedy answers (24 tokens) to ten fixed chat prompts, counted
identical to fp32's. Each row is a load as the server does it (:func:`load_weights`, the second
with each of the int4 layers' input formats: ``--matmul-inputs``); the first and the last two
read the paragraph and answer through the engine's paged runner over a KV cache (the server's own
choice of ``--kv-cache-dtype``, then fp32 and bf16), the others through the plain model. Targets of
the issue "Weights kept in their bits": ≤ 0.05 nats, ≥ 98 % top-1, ≥ 8 of 10 answers; an fp32
checkpoint quantised at load (``int4`` without the GGUF's bits) within 0.15 nats.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile

PARAGRAPH = (
    "When on board H.M.S. Beagle, as naturalist, I was much struck with certain facts in the distribution of the "
    "inhabitants of South America, and in the geological relations of the present to the past inhabitants of that "
    "continent. These facts seemed to me to throw some light on the origin of species, that mystery of mysteries, "
    "as it has been called by one of our greatest philosophers. On my return home, it occurred to me, in 1837, that "
    "something might perhaps be made out on this question by patiently accumulating and reflecting on all sorts of "
    "facts which could possibly have any bearing on it."
)
QUESTIONS = (
    "What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
    "What is 12 times 12?", "Write a haiku about the sea.", "Who wrote Romeo and Juliet?",
    "What does a thermometer measure?", "Give me a synonym for happy.", "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
)  # fmt: skip


def _answers(model, tokenizer, kv_dtype=None, new_tokens: int = 24) -> list[list[int]]:
    """Greedy answers to :data:`QUESTIONS`: transformers' ``generate``, or with ``kv_dtype`` the
    engine's paged runner over a KV cache in that dtype (the prompt at once, then a token a step)."""
    import torch

    from gyrfalcon.engine.model.work import Work

    out = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        if kv_dtype is not None:
            with _paged(model, kv_dtype, len(prompt) + new_tokens) as (runner, blocks):
                got, fed, start = [], prompt, 0
                while len(got) < new_tokens and not (got and got[-1] == tokenizer.eos_token_id):  # as generate stops
                    logits, _ = runner.forward([Work(fed, start, blocks)])
                    start += len(fed)
                    fed = [int(logits[-1].argmax())]
                    got.append(fed[0])
            out.append(got)
            continue
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)  # fmt: skip
        out.append(got[0, ids.shape[1] :].tolist())
    return out


@contextlib.contextmanager
def _paged(model, kv_dtype, tokens: int):
    """The engine's paged runner over ``model`` with a KV cache in ``kv_dtype`` holding ``tokens``
    (block 0 left as the engine's scratch), and that sequence's block table."""
    from gyrfalcon.engine.kv.cache import KVShape, PagedKVCache
    from gyrfalcon.engine.model.runner import ModelRunner

    blocks = -(-tokens // 16)
    plain = model.config._attn_implementation  # the runner registers its own; generate needs this back
    runner = ModelRunner(model, PagedKVCache(KVShape.of(model.config, kv_dtype), blocks + 1, 16, "cpu"))
    try:
        yield runner, list(range(1, blocks + 1))
    finally:
        model.config._attn_implementation = plain


def _logprobs(model, ids, kv_dtype=None):
    """Log-probabilities at every position of ``ids`` (``[1, T]``): a plain forward, or with
    ``kv_dtype`` the engine's paged runner over a KV cache in that dtype (prefilled at once)."""
    import torch

    from gyrfalcon.engine.model.work import Work

    with torch.inference_mode():
        if kv_dtype is None:
            return torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        with _paged(model, kv_dtype, ids.shape[1]) as (runner, blocks):
            logits, _ = runner.forward([Work(ids[0].tolist(), 0, blocks, "all")])
        return torch.log_softmax(logits.float(), dim=-1)


def _without_bits(path: str) -> str:
    """The checkpoint at ``path`` as a plain fp32 folder (its GGUF bits left out), in a new temporary folder."""
    from gyrfalcon.models.gguf_bits import BITS_FILE

    folder = tempfile.mkdtemp(prefix="gyrfalcon-quality-")
    for name in os.listdir(path):
        if name != BITS_FILE:
            os.symlink(os.path.join(path, name), os.path.join(folder, name))
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gyrfalcon.bench.quality", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder or .gguf (default: the embedded default model)")
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args(argv)
    import torch

    from gyrfalcon.models.default import resolve_model
    from gyrfalcon.models.gguf_bits import BITS_FILE
    from gyrfalcon.engine.kv.cache import cache_dtype
    from gyrfalcon.models.loading import load_tokenizer, load_weights

    torch.set_num_threads(args.num_threads)
    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    ids = tokenizer(PARAGRAPH)["input_ids"]
    if tokenizer.bos_token_id is not None and ids[:1] != [tokenizer.bos_token_id]:
        ids = [tokenizer.bos_token_id, *ids]
    ids = torch.tensor([ids])
    reference, _ = load_weights(path, "float32", "cpu", "none")
    ref_lp, ref_answers = _logprobs(reference, ids), _answers(reference, tokenizer)
    del reference
    server_kv = cache_dtype(torch.float32, quantized=True)  # the KV cache the server keeps beside these layers
    rows = [(f"auto (the server's default: {str(server_kv).removeprefix('torch.')} KV cache, the engine's paged runner)", "auto", "auto", True, server_kv, None),
            ("auto, the plain model (no KV cache)", "auto", "auto", True, None, None),
            ("auto, --matmul-inputs float32", "auto", "auto", True, None, torch.float32),
            ("auto, --matmul-inputs int16", "auto", "auto", True, None, torch.int16),
            ("auto, --matmul-inputs int8", "auto", "auto", True, None, torch.int8),
            ("int8", "auto", "int8", True, None, None),
            ("int4 quantised at load (the GGUF's bits unused)", "auto", "int4", False, None, None),
            ("bfloat16, no quantisation", "bfloat16", "none", True, None, None),
            ("auto, --kv-cache-dtype float32, the engine's paged runner", "auto", "auto", True, torch.float32, None),
            ("auto, --kv-cache-dtype bfloat16, the engine's paged runner", "auto", "auto", True, torch.bfloat16, None)]  # fmt: skip
    print(f"{os.path.basename(path)}: {ids.shape[1]} tokens of the paragraph, {len(QUESTIONS)} chat prompts; against fp32 without quantisation\n")
    print("| weights | what the layers run in | mean abs Δ log p (nats) | top-1 agreement | greedy answers identical |")
    print("|---|---|---|---|---|")
    for label, dtype, mode, with_bits, kv_dtype, inputs in rows:
        folder = path if with_bits or not os.path.isfile(os.path.join(path, BITS_FILE)) else _without_bits(path)
        model, report = load_weights(folder, dtype, "cpu", mode, inputs=inputs)
        lp = _logprobs(model, ids, kv_dtype)
        same = sum(a == b for a, b in zip(_answers(model, tokenizer, kv_dtype), ref_answers))
        delta = float((lp - ref_lp).abs().mean())
        top1 = float((lp.argmax(-1) == ref_lp.argmax(-1)).float().mean())
        print(f"| {label} | {report.describe().removeprefix('weights: ')} | {delta:.4f} | {top1:.1%} | {same} of {len(QUESTIONS)} |", flush=True)
        if folder != path:
            shutil.rmtree(folder, ignore_errors=True)
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
