"""The ceilings: loops over the same model, prompts, dtype and device as the server, with nothing around them.

- :func:`bare_loop`, the eager ceiling: prefill every prompt in one batch (equal lengths, so no
  padding), then decode greedily in one batch with transformers' ``DynamicCache``, the 2D mask and
  explicit positions — what the engine does at its best, minus everything around the forward. On a
  CPU this is the ceiling; on a GPU an eager step is bound by kernel launches.
- :func:`compiled_loop`, the compiled ceiling: ``model.generate`` with a static cache, which
  transformers compiles (``torch.compile``, CUDA graphs on a GPU) by itself for the decode step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gyrfalcon.bench.client import say


@dataclass
class CeilingResult:
    """One ceiling run: ``batch`` prompts, ``new_tokens`` generated per row (the prefill makes the first).

    ``compile_s`` is the wall time of the first (compiling) call of a compiled run, None for eager.
    """

    batch: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    compile_s: float | None = None

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.batch * self.new_tokens / self.total_s

    @property
    def time_per_step(self) -> float:
        """Decode seconds per step (= time per output token of each row)."""
        return self.decode_s / max(self.new_tokens - 1, 1)


def load(model_path: str, dtype: str | None = "float32", threads: int = 1, device: str | None = "cpu",
         quantization: str = "none"):  # fmt: skip
    """Load the model as the server does (``device``, ``dtype``, ``--quantization``, ``threads`` torch threads)."""
    import torch

    from gyrfalcon.models.loading import load_weights

    torch.set_num_threads(threads)
    return load_weights(model_path, dtype, device, quantization)[0]


def _sync(device) -> None:
    """Wait for the device's queued work, so that wall-clock times cover it (a no-op on CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(model, prompts: list[list[int]]):
    import torch

    batch, length = len(prompts), len(prompts[0])
    assert all(len(p) == length for p in prompts), "the ceilings take prompts of equal length"
    ids = torch.tensor(prompts, device=model.device)
    return ids, torch.ones((batch, length), dtype=torch.long, device=model.device)


def bare_loop(model, prompts: list[list[int]], new_tokens: int) -> CeilingResult:
    """Prefill ``prompts`` (equal lengths) in one forward, then ``new_tokens - 1`` greedy decode steps."""
    import torch
    from transformers import DynamicCache

    device = model.device
    input_ids, mask = _inputs(model, prompts)
    batch, length = input_ids.shape
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        _sync(device)
        start = time.perf_counter()
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=torch.arange(length, device=device).expand(batch, -1),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        token = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        _sync(device)
        prefilled = time.perf_counter()
        for step in range(1, new_tokens):
            width = length + step
            out = model(
                input_ids=token,
                attention_mask=torch.ones((batch, width), dtype=torch.long, device=device),
                position_ids=torch.full((batch, 1), width - 1, device=device),
                cache=cache,
                use_cache=True,
            )
            token = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        _sync(device)
        done = time.perf_counter()
    return CeilingResult(batch, new_tokens, prefilled - start, done - prefilled)


def _generate_s(model, input_ids, mask, new_tokens: int, compile: bool) -> float:
    """Seconds of one greedy static-cache ``generate`` of exactly ``new_tokens`` tokens per row."""
    import torch

    kwargs = {}
    if not compile:
        kwargs["disable_compile"] = True
    elif model.device.type != "cuda":
        from transformers import CompileConfig

        config = CompileConfig()
        config._compile_all_devices = True  # transformers compiles by itself on accelerators only
        kwargs["compile_config"] = config
    pad = model.generation_config.pad_token_id
    _sync(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # random weights may emit eos: it must not end a row early
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0 if pad is None else pad,
            **kwargs,
        )
    _sync(model.device)
    seconds = time.perf_counter() - start
    if out.shape[1] != input_ids.shape[1] + new_tokens:
        raise RuntimeError(f"generate made {out.shape[1] - input_ids.shape[1]} tokens, not {new_tokens}")
    return seconds


def compiled_loop(model, prompts: list[list[int]], new_tokens: int, compile: bool = True) -> CeilingResult:
    """The static-cache ``generate`` loop at batch ``len(prompts)``; compiled unless ``compile`` is False.

    The first call compiles and captures the decode step (its wall time, one run included, is
    ``compile_s``); the second is timed with ``new_tokens`` tokens, then, after a warm-up, one with a
    single token: the prefill alone, which transformers runs uncompiled. ``generate`` reports no
    per-step time, so the decode time is the difference of the two timed calls (``generate``'s own
    fixed overhead cancels out), and the time per step that difference divided by ``new_tokens - 1``.
    Each call builds its static cache at the longest length seen so far, so the one-token calls keep
    the compiled graph's shapes. On a CPU transformers compiles only when told to, which this does.
    """
    if new_tokens < 2:
        raise ValueError("the compiled ceiling needs at least 2 new tokens")
    if compile:
        import torch._dynamo

        # each batch size is one more compilation of the same code; past the limit dynamo falls back to eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    input_ids, mask = _inputs(model, prompts)
    first = _generate_s(model, input_ids, mask, new_tokens, compile)
    total = _generate_s(model, input_ids, mask, new_tokens, compile)
    _generate_s(model, input_ids, mask, 1, compile)  # warm-up of the prefill alone
    prefill = _generate_s(model, input_ids, mask, 1, compile)
    return CeilingResult(len(prompts), new_tokens, prefill, max(total - prefill, 0.0), compile_s=first if compile else None)


def run_ceilings(model_path: str, args: Any, device: str, prompts: list[list[int]]) -> dict[str, Any]:
    """The eager ceiling at every level of ``args.concurrency`` (``gyrfalcon bench``'s options), then the compiled one where enabled; a compile failure ends only the latter.

    Returns ``eager`` and ``compiled`` ({batch: CeilingResult}), ``compiled_error`` and, on CUDA,
    ``peak_memory`` (bytes allocated at most while the ceilings ran).
    """
    import torch

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    baseline: dict[int, CeilingResult] = {}
    if not cuda:  # the fp32 eager loop without quantisation: the CPU targets' baseline
        plain = load(model_path, "float32", args.num_threads, device, "none")
        for c in args.concurrency:
            bare_loop(plain, prompts[:c], 2)
            baseline[c] = bare_loop(plain, prompts[:c], args.output_tokens)
            say(f"fp32 eager loop at batch {c}: {baseline[c].output_tokens_per_s:.1f} tok/s")
        del plain
    model = load(model_path, args.dtype, args.num_threads, device, args.quantization)
    eager: dict[int, CeilingResult] = {}
    compiled: dict[int, CeilingResult] = {}
    error = None
    for c in args.concurrency:
        bare_loop(model, prompts[:c], 2)  # warm-up at this batch size
        eager[c] = bare_loop(model, prompts[:c], args.output_tokens)
        say(f"eager ceiling at batch {c}: {eager[c].output_tokens_per_s:.1f} tok/s, step {eager[c].time_per_step * 1000:.2f} ms")
    if args.compiled_ceiling:
        for c in args.concurrency:
            try:
                compiled[c] = r = compiled_loop(model, prompts[:c], args.output_tokens)
            except Exception as exc:  # a compiler failure must not lose the rest of the report
                error = f"at batch {c}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                say(f"compiled ceiling failed {error}")
                break
            say(f"compiled ceiling at batch {c}: compile + capture {r.compile_s:.1f} s, "
                f"{r.output_tokens_per_s:.1f} tok/s, step {r.time_per_step * 1000:.2f} ms")  # fmt: skip
    peak = torch.cuda.max_memory_allocated() if cuda else None
    del model
    if cuda:
        torch.cuda.empty_cache()
    return {"eager": eager, "compiled": compiled, "compiled_error": error, "peak_memory": peak, "baseline": baseline}
