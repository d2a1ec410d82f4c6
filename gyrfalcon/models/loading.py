"""Loading a local Hugging Face folder (never from a hub)."""

from __future__ import annotations

import os
from typing import Any

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def resolve_device(device: str | None) -> str:
    """``auto`` (or None) → ``cuda`` when available, else ``cpu``; anything else as given."""
    import torch

    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str | None, device: str) -> Any:
    """The torch dtype for a ``--dtype`` setting; ``auto`` is bf16 on CUDA, fp32 on CPU."""
    import torch

    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, DTYPES[dtype])


def load_model(path: str | os.PathLike[str], dtype: str | None = "float32", device: str | None = "cpu"):
    """Load the causal LM of a local Hugging Face folder, in eval mode on ``device``.

    ``dtype`` is a ``Settings.dtype`` string (``float32``, ``bfloat16``, ``float16``, ``auto``).
    Never touches the network (``local_files_only=True``); thread counts are left to the caller.
    """
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(
        os.fspath(path), local_files_only=True, dtype=resolve_dtype(dtype, device)
    )
    model.to(device)
    model.eval()
    return model


def load_tokenizer(path: str | os.PathLike[str]):
    """Load the tokenizer of a local Hugging Face folder (never from a hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)


def load_model_and_tokenizer(path: str | os.PathLike[str], dtype: str | None = "float32", device: str | None = "cpu"):
    """Load ``(model, tokenizer)`` from a local Hugging Face folder: see :func:`load_model`."""
    return load_model(path, dtype, device), load_tokenizer(path)
