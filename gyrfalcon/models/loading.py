"""Loading a local Hugging Face folder (never from a hub), in the dtype and weight kernels asked for."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def resolve_device(device: str | None) -> str:
    """``auto`` (or None) → ``cuda`` when available, else ``cpu``; anything else as given."""
    import torch

    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str | None, device: str) -> Any:
    """The model's dtype for a ``--dtype`` setting (its residual stream, norms, attention and KV cache);
    ``auto`` is bf16 on CUDA, fp32 on CPU. The weight-only kernels pick their own: :func:`kernel_dtype`."""
    import torch

    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, DTYPES[dtype])


def kernel_dtype(dtype: Any, device: str, mode: str = "int4") -> Any:
    """The format the quantised matmuls take their inputs in, for ``--quantization`` ``mode``:

    - ``int4`` on an x86 CPU with AVX2 or AVX-512: our kernels' format for that instruction set
      (:func:`gyrfalcon.kernels.quant.q4.q4_inputs`: 15-bit integer blocks, by measurement);
    - bf16 on CUDA (tinygemm's only one) and, for torch's int8 kernel, on CPUs with AVX2 or AVX-512,
      where torch's kernels are fast only with bf16 inputs (16-30x their fp32 and fp16 paths);
    - the model's ``dtype`` elsewhere.

    The model's stream stays in ``dtype`` (on the default model a bf16 stream alone moves
    log-probabilities by 0.062 nats: docs/kernels.md)."""
    import torch

    from gyrfalcon.kernels.native.cpu import cpu
    from gyrfalcon.kernels.quant.q4 import q4_inputs, q4_kernel

    if device.startswith("cuda"):
        return torch.bfloat16
    if device == "cpu" and mode == "int4" and q4_kernel():
        return q4_inputs()
    if device == "cpu" and cpu().avx2:
        return torch.bfloat16
    return dtype


def resolve_quantization(setting: str, path: str | os.PathLike[str], dtype: Any, device: str) -> str:
    """``--quantization`` for the folder at ``path`` in the model ``dtype`` on ``device``: see
    :func:`gyrfalcon.kernels.quant.apply.resolve_quantization` (``auto`` needs a GGUF's bits)."""
    from gyrfalcon.kernels.quant.apply import resolve_quantization as resolve
    from gyrfalcon.models.gguf_bits import BITS_FILE

    has_bits = os.path.isfile(os.path.join(os.fspath(path), BITS_FILE))
    return resolve(setting, has_bits, kernel_dtype(dtype, device, "int4" if setting == "auto" else setting), device)


def load_weights(path: str | os.PathLike[str], dtype: str | None = "float32", device: str | None = "cpu",
                 quantization: str = "none", cache_dir: str | None = None, inputs: Any = None,
                 release: bool = True):  # fmt: skip
    """Load the causal LM of a local folder in eval mode on ``device``, its layers in the kernels of
    ``--quantization`` (``auto``, ``none``, ``int4``, ``int8``: see
    :mod:`gyrfalcon.kernels.quant.apply`); returns ``(model, QuantizationReport)``.

    ``dtype`` is a ``Settings.dtype`` string (``float32``, ``bfloat16``, ``float16``, ``auto``).
    Never touches the network (``local_files_only=True``); thread counts are left to the caller.
    Kernels built for this machine are kept under ``cache_dir`` (``--cache-dir``'s default: see
    :func:`gyrfalcon.models.default.cache_root`). ``inputs``: the matmuls' input format where it is
    not :func:`kernel_dtype`'s (the quality harness compares them). ``release``: hand what the
    quantising freed back to the system before returning (a caller that does so later says False:
    the collection it takes is a fifth of a load of the default model).
    """
    from transformers import AutoModelForCausalLM

    from gyrfalcon.kernels.quant.apply import quantize_model
    from gyrfalcon.heap import release_freed_memory
    from gyrfalcon.models.default import cache_root
    from gyrfalcon.models.gguf_bits import read_bits

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    mode = resolve_quantization(quantization, path, torch_dtype, device)
    model = AutoModelForCausalLM.from_pretrained(os.fspath(path), local_files_only=True, dtype=torch_dtype)
    model.to(device)
    model.eval()
    bits = read_bits(path) if mode != "none" else None
    compute = inputs if inputs is not None else kernel_dtype(torch_dtype, device, mode)
    report = quantize_model(model, mode, bits, compute, device, kernels=cache_root(cache_dir) / "kernels")
    if mode != "none":
        del bits
        _copy_small_tensors(model)
        if release:
            release_freed_memory()
    return model, report


#: bytes under which a parameter left after quantising is copied out of the weights file
SMALL_TENSOR_BYTES = 1 << 20


def _copy_small_tensors(model: Any) -> None:
    """Copy the small parameters left after quantising (norms, biases) into memory of their own:
    each one still read from the weights file keeps the whole file mapped, with every page the load
    touched (12 MiB on the default model, for 61 norms of 2 KiB). Large ones (an embedding left
    unquantised) stay mapped: only the rows read become resident. The quantised layers' buffers are
    the kernels' own memory already (and may be views the kernels hold: never replaced here)."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.device.type == "cpu" and parameter.nbytes < SMALL_TENSOR_BYTES:
                parameter.data = parameter.data.clone()


def load_model(path: str | os.PathLike[str], dtype: str | None = "float32", device: str | None = "cpu"):
    """The model of :func:`load_weights` with every layer in ``dtype`` (no quantisation)."""
    return load_weights(path, dtype, device, "none")[0]


#: tokenizer classes that are transformers' plain fast tokenizer over ``tokenizer.json``
PLAIN_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | os.PathLike[str]):
    """Load the tokenizer of a local Hugging Face folder (never from a hub).

    A plain fast tokenizer (``tokenizer.json``, :data:`PLAIN_TOKENIZERS`) is loaded as it is: through
    ``AutoTokenizer`` transformers reads the model's config, whose module imports torch — about 230
    MiB more in each API worker, which needs no torch. Any other tokenizer goes through ``AutoTokenizer``."""
    import json

    folder = os.fspath(path)
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    if (config.get("tokenizer_class") in PLAIN_TOKENIZERS and not config.get("auto_map")
            and os.path.isfile(os.path.join(folder, "tokenizer.json"))):  # fmt: skip
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def load_model_and_tokenizer(path: str | os.PathLike[str], dtype: str | None = "float32", device: str | None = "cpu"):
    """Load ``(model, tokenizer)`` from a local Hugging Face folder: see :func:`load_model`."""
    return load_model(path, dtype, device), load_tokenizer(path)
