"""What a :class:`~gyrfalcon.engine.transformers_engine.TransformersEngine` is built from: the
model folder's facts (read at construction, quickly) and the loaded, warmed-up runner (on the
engine's thread): weights in their kernels, the KV cache sized and allocated, the decode path
prepared and checked."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from gyrfalcon.engine.kv.blocks import BlockPool
from gyrfalcon.engine.kv.cache import CachePlan, KVShape, PagedKVCache, cache_dtype, plan_cache
from gyrfalcon.engine.lora.registry import LoraRegistry, projection_shapes
from gyrfalcon.engine.model.budget import PeakProbe, StepReserve, cuda_peak, measure_reserve, provisional_blocks
from gyrfalcon.engine.model.fast_check import DecodePath
from gyrfalcon.engine.model.runner import ModelRunner
from gyrfalcon.engine.model.work import Work
from gyrfalcon.engine_api.config import EngineConfig, LoraConfig, SpeculativeConfig
from gyrfalcon.engine_api.types import EngineInfo
from gyrfalcon.models.default import cache_root
from gyrfalcon.heap import release_freed_memory
from gyrfalcon.models.loading import load_tokenizer, load_weights, resolve_dtype
from gyrfalcon.validation import NATIVE_CAPABILITIES, policies

log = logging.getLogger("gyrfalcon.engine.transformers_engine")

#: the sampling fields of a generation_config.json the API's defaults come from (vLLM's list)
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # fmt: skip


def capture_mode(cfg: EngineConfig, device: str) -> str:
    """The decode steps' fast path unless ``--enforce-eager``: CUDA graphs on CUDA, on the CPU the
    compiled step (unless ``--no-compile-decode``)."""
    kind = torch.device(device).type
    mode = "off"
    # with LoRA, a captured or compiled step takes each row's adapter slot from a static buffer
    # (gyrfalcon.engine.lora.step)
    if not cfg.enforce_eager:
        mode = "cuda-graphs" if kind == "cuda" else "compiled" if kind == "cpu" and cfg.compile_decode else "off"
    if mode == "compiled":  # inductor's code cached beside the models (read at its first use)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root(cfg.cache_dir) / "inductor"))
    return mode


@dataclass
class ModelFacts:
    """A model folder's config, end-of-text ids, context length and sampling defaults."""

    config: Any
    eos_token_ids: list[int]
    max_model_len: int
    sampling_defaults: dict[str, Any]


def read_model(path: str, cfg: EngineConfig) -> ModelFacts:
    """The facts of the model folder at ``path`` (config and tokenizer only: no weights). The
    tokenizer is read for its end-of-text id and let go: the core deals in token ids, and the
    process that serves it (the engine process) has no other use for the 13 MiB it holds."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    tokenizer = load_tokenizer(path)
    try:
        generation = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        generation = None
    model_max = int(getattr(config, "max_position_embeddings", 0) or cfg.max_model_len or 2048)
    if cfg.max_model_len and cfg.max_model_len > model_max:
        log.warning("max_model_len %d exceeds the model's %d positions; using %d", cfg.max_model_len, model_max, model_max)
    defaults = _sampling_defaults(generation) if cfg.generation_config == "auto" else {}
    return ModelFacts(config, _eos_ids(generation, tokenizer), min(cfg.max_model_len or model_max, model_max),
                      defaults)  # fmt: skip


def engine_info(cfg: EngineConfig, facts: ModelFacts, dtype: torch.dtype, device: str, quantization: str,
                pm: Any) -> tuple[EngineInfo, list[Any], list[Any]]:  # fmt: skip
    """What an engine of ``cfg`` serving the model of ``facts`` serves and can honour, with the
    logits processors and logprob gatherers the plugins of ``pm`` give it (their fields are among
    its capabilities)."""
    info = EngineInfo(
        model_path=str(cfg.model),
        vocab_size=int(facts.config.vocab_size),
        max_model_len=facts.max_model_len,
        eos_token_ids=facts.eos_token_ids,
        max_logprobs=cfg.max_logprobs,
        max_num_seqs=cfg.max_num_seqs,
        capabilities=NATIVE_CAPABILITIES,
        max_request_seqs=cfg.max_request_seqs,
        default_sampling=facts.sampling_defaults,
        dtype=str(dtype).removeprefix("torch."),
        device=device,
        quantization=quantization,
        logprobs_mode=cfg.logprobs_mode,
    )
    processors, gatherers = policies(pm, info)
    capabilities = set(NATIVE_CAPABILITIES)
    if cfg.scheduling_policy == "priority":
        capabilities.add("priority")
    if cfg.enable_lora:
        capabilities.add("lora")
    for policy in [*processors, *gatherers]:
        capabilities |= set(policy.fields)
    info.capabilities = frozenset(capabilities)
    return info, processors, gatherers


def _sampling_defaults(generation: Any) -> dict[str, Any]:
    """The sampling fields the model's generation_config.json sets, by API name."""
    given = generation.to_diff_dict() if generation is not None else {}
    defaults = {api: given[name] for name, api in GENERATION_CONFIG_FIELDS.items() if given.get(name) is not None}
    if defaults:
        log.warning("sampling defaults from the model's generation config (--generation-config auto): %s", defaults)
    return defaults


def _eos_ids(generation: Any, tokenizer: Any) -> list[int]:
    eos = generation.eos_token_id if generation is not None else None
    ids: list[int] = []
    for value in [*(eos if isinstance(eos, list) else [eos]), tokenizer.eos_token_id]:
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def _measure(runner: ModelRunner, shape: KVShape, cfg: EngineConfig, max_model_len: int, prefill_chunk: int,
             probe: PeakProbe) -> StepReserve:  # fmt: skip
    """What the steps take beside the KV cache, measured on the runner's provisional cache, whose
    memory then goes back (the runner keeps a one-block cache until the real one is made)."""
    reserve = measure_reserve(runner, cfg.max_num_batched_tokens, prefill_chunk, max_model_len, probe)
    runner.use_cache(PagedKVCache(shape, 1, cfg.block_size, runner.device))
    from torch import _dynamo

    _dynamo.reset()  # flex attention compiled for the provisional cache's size: compiled anew for the real one
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    log.warning("%s", reserve.describe())
    return reserve


def step_probe(device: str) -> PeakProbe | None:
    """How the steps' memory beside the KV cache is measured before the cache is sized: on CUDA
    (None elsewhere: the CPU's cache budget is its own share of host memory)."""
    return cuda_peak(torch.device(device)) if device.startswith("cuda") else None


@dataclass
class LoadedModel:
    """A runner ready to step, with its block pool, the cache plan and the decode path taken."""

    runner: ModelRunner
    pool: BlockPool
    plan: CachePlan
    decode_path: DecodePath
    #: speculative decoding as it serves (``--speculative-config``), or why it does not; "" when not asked
    speculative: str = ""
    #: whether draft rows give the decode steps' bits here (:meth:`ModelRunner.rows_alike`)
    speculates: bool = False


def load_runner(cfg: EngineConfig, max_model_len: int, device: str, quantization: str, capture: str,
                prefill_chunk: int) -> LoadedModel:  # fmt: skip
    """Load the weights in their kernels, size and allocate the KV cache (on CUDA, after measuring
    what the steps take beside it: :mod:`~gyrfalcon.engine.model.budget`), warm up and prepare the
    decode path (capture or compile, checked against the eager step)."""
    if device == "cpu":
        torch.set_num_threads(cfg.num_threads)
    inputs = None if cfg.matmul_inputs == "auto" else getattr(torch, cfg.matmul_inputs)
    model, weights = load_weights(str(cfg.model), cfg.dtype, device, quantization, cfg.cache_dir, inputs)
    log.warning("%s", weights.describe())
    kv_dtype = (cache_dtype(next(model.parameters()).dtype, weights.mode != "none") if cfg.kv_cache_dtype == "auto"
                else resolve_dtype(cfg.kv_cache_dtype, device))  # fmt: skip
    shape = KVShape.of(model.config, kv_dtype)

    def runner_on(cache: PagedKVCache) -> ModelRunner:
        return ModelRunner(model, cache, capture=capture, max_batch=cfg.max_num_seqs, max_model_len=max_model_len,
                           model_impl=cfg.model_impl, attention=cfg.attention_backend,
                           kernels=cache_root(cfg.cache_dir) / "kernels",
                           verdicts=cache_root(cfg.cache_dir) / "inductor")  # fmt: skip

    runner, reserve = None, StepReserve(0, 0)
    probe = step_probe(device) if cfg.kv_cache_memory is None else None  # sized by --gpu-memory-utilization
    if probe is not None:
        runner = runner_on(PagedKVCache(shape, provisional_blocks(max_model_len, cfg.block_size), cfg.block_size, device))
        reserve = _measure(runner, shape, cfg, max_model_len, prefill_chunk, probe)
    plan = plan_cache(shape, device, cfg.block_size, cfg.max_num_seqs, max_model_len, cfg.kv_cache_memory,
                      cfg.gpu_memory_utilization, reserve.total, reserve.per_block)  # fmt: skip
    log.warning("%s; %s", plan.describe(max_model_len), str(shape.dtype).removeprefix("torch."))
    cache = PagedKVCache(shape, plan.num_blocks, plan.block_size, device)
    pool = BlockPool(plan.num_blocks, plan.block_size, cfg.enable_prefix_caching)
    if runner is None:
        runner = runner_on(cache)
    else:
        runner.use_cache(cache)
    # Warm-up through the same kernels as requests, on the scratch block only (no request's KV),
    # each step also checking the direct forward against transformers' and flex attention against gather.
    with torch.inference_mode():
        scratch = [pool.SCRATCH]
        steps = [[Work([5, 6], 0, scratch, "all"), Work([7], 0, scratch)], [Work([5], 1, scratch), Work([6], 1, scratch)]]
        log.warning("forward: %s", runner.check_direct(steps, required=cfg.model_impl == "direct" or cfg.enable_lora))
        log.warning("attention: %s", runner.check_attention(steps, required=cfg.attention_backend == "flex"))
        if not cfg.enforce_eager:  # decode rows' layers in one call where that gives the operators' bits
            log.warning("decode layers: %s", runner.check_layer_loop(scratch))
        _attach_lora(cfg, runner, device)  # before the decode path's static steps are made
        started = time.perf_counter()
        if runner.decode_steps is not None:
            path = runner.decode_steps.prepare(background=True)
        elif runner.direct is not None and runner.direct.layer_loop is not None:
            path = DecodePath("native", runner.direct.layer_loop.describe())
        else:
            path = DecodePath("eager", "--enforce-eager" if cfg.enforce_eager else
                              "--enable-lora, where the compiled step does not serve adapters (a stream other "
                              "than fp32)" if cfg.enable_lora else
                              "--no-compile-decode" if device == "cpu" else "no fast path on this device")  # fmt: skip
        log.warning("decode path: %s (prepared in %.1f s)", path.describe(), time.perf_counter() - started)
        speculative, speculates = _speculation(cfg, runner, scratch)
    runner.forwards = 0
    release_freed_memory()  # what fusing the layers and warming up freed (the parts' own copies of fused weights)
    return LoadedModel(runner, pool, plan, path, speculative, speculates)


def _attach_lora(cfg: EngineConfig, runner: ModelRunner, device: str) -> None:
    """``--enable-lora`` (on the direct forward): the adapters' registry, its slots empty, as the
    runner's; the CPU's compiled step, whose adapter products are the fp32 kernel's, only on an fp32
    stream (a CUDA graph's are matmuls in any dtype)."""
    if not cfg.enable_lora or runner.direct is None:
        return
    config = LoraConfig.of(cfg)
    with torch.inference_mode(False):  # loads write its stacks in place outside inference mode
        runner.lora_registry = LoraRegistry(projection_shapes(runner.direct.layers), config.max_loras,
                                            config.max_lora_rank, device, config.max_cpu_loras)  # fmt: skip
    if runner.model.dtype != torch.float32 and runner.decode_steps is not None and runner.decode_steps.mode == "compiled":
        runner.decode_steps = None


def _speculation(cfg: EngineConfig, runner: ModelRunner, scratch: list[int]) -> tuple[str, bool]:
    """``--speculative-config`` as it serves: only where a draft row computes what the decode step
    it replaces would (then every token is the model's own), else off, saying why."""
    config = SpeculativeConfig.parse(cfg.speculative_config)
    if config is None:
        return "", False
    problem = runner.rows_alike(scratch)
    described = config.describe() if problem is None else f"off ({problem})"
    log.warning("speculative decoding: %s", described)
    return described, problem is None
