"""A benchmark subject of a real shape with random weights, for machines that cannot fetch weights.

Speed depends on shapes, not on trained values: a model built from a real architecture's
``config.json`` with random weights, beside a real tokenizer, serves and decodes at the same speed as
the trained model. The folder is an ordinary Hugging Face folder (safetensors, config, tokenizer),
so ``gyrfalcon serve --model`` and the ceilings load it like any other.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

#: special-token ids of the config that are replaced by the tokenizer's when they do not fit it
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _config_file(config: str | os.PathLike[str]) -> Path:
    path = Path(config)
    return path / "config.json" if path.is_dir() else path


def folder_name(config: str | os.PathLike[str]) -> str:
    """``random-<name>``: the folder (and so the served model) is named after the config's folder or file."""
    path = _config_file(config)
    stem = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return f"random-{stem or 'model'}"


def _fits(value, size: int) -> bool:
    values = value if isinstance(value, list) else [value]
    return all(isinstance(v, int) and 0 <= v < size for v in values) and bool(values)


def build_random_model(
    config: str | os.PathLike[str],
    tokenizer_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    device: str = "cpu",
    dtype: str | None = "auto",
    seed: int = 0,
) -> Path:
    """Write a causal LM with random weights of ``config``'s shape and ``tokenizer_dir``'s tokenizer to ``out``.

    ``config`` is a Hugging Face ``config.json`` (or a folder holding one). The weights are created
    directly on ``device`` (a 1-2 B model takes seconds on a GPU) in ``dtype`` (``auto``: bf16 on CUDA,
    fp32 on CPU) and saved as safetensors. The vocabulary is widened to the tokenizer's size when it
    is smaller, and special-token ids the tokenizer does not have are replaced by the tokenizer's, so
    every token id the tokenizer can produce is a row of the embedding. Never touches the network.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from gyrfalcon.models.loading import resolve_device, resolve_dtype

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    with open(_config_file(config)) as f:
        raw = json.load(f)
    raw.pop("quantization_config", None)  # random weights are never quantized
    cfg = AutoConfig.for_model(**raw)
    tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer_dir), local_files_only=True)
    size = len(tokenizer)
    text_cfg = cfg.get_text_config(decoder=True)
    if text_cfg.vocab_size is None or text_cfg.vocab_size < size:
        text_cfg.vocab_size = size
    for name in _SPECIAL_IDS:
        token_id = getattr(tokenizer, name, None)
        if token_id is not None and not _fits(getattr(text_cfg, name, None), size):
            setattr(text_cfg, name, token_id)
    cfg.dtype = torch_dtype

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def build_timed(config: str, tokenizer_dir: str, out: str, device: str, dtype: str | None, seed: int = 0) -> tuple[Path, float]:
    """:func:`build_random_model`, and the seconds it took (random init, saving and the tokenizer)."""
    start = time.perf_counter()
    path = build_random_model(config, tokenizer_dir, out, device, dtype, seed)
    return path, time.perf_counter() - start
