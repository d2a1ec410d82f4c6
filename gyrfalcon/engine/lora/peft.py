"""A PEFT LoRA folder (``adapter_config.json`` and ``adapter_model.safetensors``) as plain tensors.

What is served: ``peft_type`` LORA on the attention and MLP projections (``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``) of the decoder layers, one rank
for every module, ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``). Anything else a
folder asks for — biases, DoRA, ``modules_to_save``, per-module ranks or alphas, another module, a
rank above ``--max-lora-rank``, a shape the served layer has not — is refused with a message naming
it, before anything is served with it.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import orjson
import torch

#: the projections an adapter may target
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """Why an adapter cannot be served (one line), and the field of a load that says so."""

    def __init__(self, message: str, param: str = "lora_path", found: bool = True) -> None:
        super().__init__(message)
        #: False: what it names is not there (a 404)
        self.param, self.found = param, found


#: the safetensors dtypes an adapter's factors may have, as numpy reads them (bf16: its 16 bits)
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


class FileTensor(NamedTuple):
    """Where a tensor of a safetensors file lies: its dtype's name, its shape, and its bytes'
    offsets in the file (``begin`` .. ``end``)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def file_identity(fd: int) -> tuple[int, int, int, int]:
    """What tells one version of an open file from another: device, inode, size, modification time."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _raw_header(path: Path) -> tuple[bytes, int, tuple[int, int, int, int]]:
    """The header's bytes of the safetensors file ``path``, the file's size and its :func:`file_identity`."""
    with open(path, "rb") as f:
        identity = file_identity(f.fileno())
        try:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > identity[2] - 8:
                raise ValueError("its header runs past the end")
            return f.read(length), identity[2], identity
        except (ValueError, struct.error, OSError) as exc:
            raise AdapterError(f"adapter_model.safetensors is not a safetensors file: {exc}") from None


@functools.lru_cache(maxsize=8)
def _entries(raw: bytes, size: int) -> dict[str, FileTensor]:
    """The tensors of a safetensors file as its header lists them, from the header's bytes ``raw``
    in a file of ``size`` bytes: each checked to be of a served dtype with its bytes inside the
    file; an :class:`AdapterError` for a header that is not safetensors' or a dtype not served.
    Kept by those bytes: a trainer's next version of an adapter, and every adapter of one shape
    written by one library, have the same header, and its checks cost more than reading the file's
    factors (0.7 ms warm, up to 2 ms in a serving process, for the default model's 420 tensors).
    Shared: never changed."""
    try:
        header = orjson.loads(raw)
    except ValueError as exc:  # (orjson's JSONDecodeError is a ValueError)
        raise AdapterError(f"adapter_model.safetensors is not a safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise AdapterError("adapter_model.safetensors is not a safetensors file: its header is not a JSON object")
    start, data = 8 + len(raw), size - 8 - len(raw)
    tensors = {}
    for name, entry in header.items():  # (an adapter has hundreds: each check as cheap as it can be)
        if name == "__metadata__":
            continue
        try:
            kind, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not isinstance(shape, list):
                raise ValueError(f"its shape {shape!r} is not a list of whole numbers ≥ 0")
            shape = tuple(shape)
            count = _DTYPES[kind].itemsize
            for n in shape:
                if type(n) is not int or n < 0:
                    raise ValueError(f"its shape {entry['shape']!r} is not a list of whole numbers ≥ 0")
                count *= n
            if type(begin) is not int or type(end) is not int:
                raise ValueError(f"its data_offsets {entry['data_offsets']} are not whole numbers")
            if not 0 <= begin <= end <= data or end - begin != count:
                raise ValueError(f"its bytes {begin}..{end} do not hold {list(shape)} {kind}")
        except (KeyError, TypeError, ValueError) as exc:
            raise AdapterError(f"adapter_model.safetensors: tensor {name}: {_entry_fault(entry, exc)}") from None
        tensors[name] = FileTensor(kind, shape, start + begin, start + end)
    return tensors


def _entry_fault(entry: object, exc: Exception) -> str:
    """Why a safetensors header's ``entry`` was refused (``exc``: what its check raised)."""
    if not isinstance(entry, dict):
        return "its entry is not a JSON object"
    if not isinstance(entry.get("dtype"), str) or entry["dtype"] not in _DTYPES:
        return f"dtype {entry.get('dtype')!r} is not served (F32, BF16, F16)"
    if isinstance(exc, KeyError):
        return f"its entry has no {exc}"
    return str(exc)


def file_tensors(path: Path, header: dict[str, FileTensor], identity: tuple[int, int, int, int] | None) -> dict[str, np.ndarray]:
    """The tensors ``header`` lists (:func:`_entries`) of the safetensors file ``path``, read from
    the file of ``identity`` (:func:`check_identity`), as numpy arrays — fp32 and fp16 views of its
    bytes, read in one call; bf16 widened to fp32 — for the registry to copy into its stacks
    (numpy, not torch: a call of either costs more than the copy of a factor, and an adapter has
    hundreds)."""
    start = min((t.begin for t in header.values()), default=0)
    end = max((t.end for t in header.values()), default=0)
    with open(path, "rb") as f:
        check_identity(f.fileno(), identity)
        f.seek(start)
        data = np.empty(end - start, dtype=np.uint8)  # (not zeroed first, as a bytearray is)
        if f.readinto(data) != len(data):
            raise AdapterError("adapter_model.safetensors ends early")
    tensors = {}
    for name, entry in header.items():
        dtype = _DTYPES[entry.dtype]
        array = np.frombuffer(data, dtype, math.prod(entry.shape), entry.begin - start).reshape(entry.shape)
        if entry.dtype == "BF16":  # bf16 is fp32's upper half
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = array
    return tensors


def unreadable(why: str) -> AdapterError:
    """The refusal of a weights file that could not be read (``why``: the system's words)."""
    return AdapterError(f"adapter_model.safetensors cannot be read: {why}")


def check_identity(fd: int, identity: tuple[int, int, int, int] | None) -> None:
    """An :class:`AdapterError` unless the open file ``fd`` is the one whose header was read
    (``identity``: a trainer may write the folder again meanwhile, and old offsets over new bytes
    would serve other factors without a word)."""
    if identity is not None and file_identity(fd) != identity:
        raise changed()


def changed() -> AdapterError:
    """The refusal of a weights file written again while it was read."""
    return AdapterError("adapter_model.safetensors changed while it was read: load the adapter again")


@dataclass
class LoraAdapter:
    """An adapter's low-rank factors by ``(layer, module)``: ``A`` ``[r, in]``, ``B`` ``[out, r]``;
    a row's projection gains ``scaling · (x Aᵀ) Bᵀ``. ``layout`` says where each lies in its file;
    ``factors`` holds them once read (:func:`read_factors`; on the CPU numpy views of the file).
    The registry fills a slot of its stacked factors with them (:mod:`~gyrfalcon.engine.lora.registry`,
    an fp32 file read straight into the slot), and ``factors`` empties."""

    name: str
    path: str
    rank: int
    scaling: float
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: where each ``(layer, module)``'s ``A`` and ``B`` lie in the weights file (:func:`read_factors` reads them)
    layout: dict[tuple[int, str], tuple[FileTensor, FileTensor]] = field(default_factory=dict, repr=False)
    #: the weights file's :func:`file_identity` when its header was read
    file_id: tuple[int, int, int, int] | None = None
    #: one number per load (the registry's count), keying its prefix-cache blocks: a name loaded
    #: again with other weights never finds the blocks of the first
    serial: int = 0
    #: its slot in the registry's stacked factors, and the columns of the slot (set when the registry holds it)
    slot: int = -1
    columns: tuple[int, int] = (0, 0)
    #: the registry's stacked factors, and the projections any adapter it holds has factors for
    stacks: dict = field(default_factory=dict, repr=False)
    active: set = field(default_factory=set, repr=False)


def read_adapter(name: str, path: str, shapes: dict[tuple[int, str], tuple[int, int]], max_rank: int,
                 device: str = "cpu", factors: bool = True) -> LoraAdapter:  # fmt: skip
    """The adapter of the PEFT folder ``path`` for layers of ``shapes`` (``(layer, module)`` →
    ``(out, in)``), refused with an :class:`AdapterError` for anything not served (module
    docstring): every check reads the config and the weights file's header only. ``factors``: its
    factors read too (:func:`read_factors`), else only where they lie (``layout``: the registry
    reads them into a slot itself)."""
    folder, shown = Path(path), path if len(path) <= 200 else path[:200] + "…"
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    try:
        if not folder.exists():
            raise AdapterError(f"'{shown}' does not exist on the server", "lora_path", found=False)
        if not config_file.is_file() or not weights_file.is_file():
            raise AdapterError(f"'{shown}' is not a PEFT LoRA folder (adapter_config.json and adapter_model.safetensors)")
    except OSError as exc:  # a name too long for the file system (none such exists), a folder it may not read
        missing = exc.errno in (errno.ENAMETOOLONG, errno.ENOENT, errno.ENOTDIR)
        raise AdapterError(f"'{shown}' cannot be read: {exc.strerror}", found=not missing) from None
    rank, scaling = _rank_and_scaling(config_file, max_rank)
    try:
        raw, size, identity = _raw_header(weights_file)
    except OSError as exc:  # gone or unreadable since the checks above
        raise unreadable(exc.strerror) from None
    layout = _layout(raw, size, rank, tuple(shapes.items()))
    if not layout:
        raise AdapterError(f"'{path}' holds no LoRA factor")
    adapter = LoraAdapter(name, str(path), rank, float(scaling), layout=dict(layout), file_id=identity)
    if factors:
        read_factors(adapter, device)
    return adapter


@functools.lru_cache(maxsize=8)
def _layout(raw: bytes, size: int, rank: int, projections: tuple[tuple[tuple[int, str], tuple[int, int]], ...]
            ) -> dict[tuple[int, str], tuple[FileTensor, FileTensor]]:  # fmt: skip
    """Where each ``(layer, module)``'s ``A`` and ``B`` lie in a weights file of header ``raw`` and
    ``size`` bytes (:func:`_entries`), each pair checked to fit its projection of ``projections``
    (``((layer, module), (out, in))``) at ``rank``; an :class:`AdapterError` naming the first
    tensor that does not. Kept by its arguments, as :func:`_entries` is. Shared: never changed."""
    shapes = dict(projections)
    names = factor_names(tuple(shapes))
    halves: tuple[dict, dict] = ({}, {})  # each (layer, module)'s A, and its B
    for key, tensor in _entries(raw, size).items():
        found = names.get(key) or _factor_of(key, shapes)
        halves[found[2]][found[:2]] = tensor
    a_of, b_of = halves
    layout = {}
    for layer, module in sorted(a_of.keys() | b_of.keys()):
        a, b = a_of.get((layer, module)), b_of.get((layer, module))
        if a is None or b is None:
            raise AdapterError(f"layer {layer} {module} has lora_{'A' if b is None else 'B'} without its other factor")
        out, inp = shapes[(layer, module)]
        if a.shape != (rank, inp) or b.shape != (out, rank):
            raise AdapterError(f"layer {layer} {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit "
                               f"a [{out}, {inp}] projection at rank {rank}")  # fmt: skip
        layout[(layer, module)] = (a, b)
    return layout


def warm_checks(shapes: dict[tuple[int, str], tuple[int, int]]) -> None:
    """Run the header's checks (:func:`_entries`, :func:`_layout`) once over a made-up header of
    rank 1 for ``shapes``: a process's first check of a header took 2.2 ms against 1.2-1.3 for the
    next new one (AMD Zen 3), and a registry pays that at its start, not in its first load. The
    made-up header's entries are kept as any header's (the least recently used, the first to go).
    A made-up header that fails the checks is a bug: it raises."""
    header, at = {}, 0
    for name, (layer, module, half) in factor_names(tuple(shapes)).items():
        if name.startswith("base_model."):
            out, inp = shapes[(layer, module)]
            size = 4 * (inp if half == 0 else out)
            header[name] = {"dtype": "F32", "shape": [1, inp] if half == 0 else [out, 1], "data_offsets": [at, at + size]}
            at += size
    raw = orjson.dumps(header)
    _layout.__wrapped__(raw, 8 + len(raw) + at, 1, tuple(shapes.items()))


@functools.lru_cache(maxsize=8)
def factor_names(projections: tuple[tuple[int, str], ...]) -> dict[str, tuple[int, str, int]]:
    """The names PEFT gives the factors of ``projections`` (with and without its ``base_model.model.``
    prefix) → ``(layer, module, 0 for A or 1 for B)``: a look-up instead of a match per tensor
    (kept; a registry makes its model's when it is made, not at the first load)."""
    names = {}
    for layer, module in projections:
        parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        for prefix in ("", "base_model.model."):
            for half, letter in enumerate("AB"):
                names[f"{prefix}model.layers.{layer}.{parent}.{module}.lora_{letter}.weight"] = (layer, module, half)
    return names


def _factor_of(key: str, shapes: dict[tuple[int, str], tuple[int, int]]) -> tuple[int, str, int]:
    """``(layer, module, half)`` of a tensor name :func:`factor_names` does not list, or an
    :class:`AdapterError` naming why it cannot serve."""
    match = _KEY.match(key)
    if match is None or match.group(2) not in TARGETS:
        raise AdapterError(f"tensor {key} is not a LoRA factor of a served projection ({', '.join(TARGETS)})")
    layer, module = int(match.group(1)), match.group(2)
    if (layer, module) not in shapes:
        raise AdapterError(f"tensor {key}: the served model has no layer {layer} {module}")
    return layer, module, "AB".index(match.group(3))


def _rank_and_scaling(config_file: Path, max_rank: int) -> tuple[int, float]:
    """The rank and scaling an ``adapter_config.json`` asks for, refused with an :class:`AdapterError`
    for anything not served (the module docstring)."""
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise AdapterError(f"{config_file.name} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_file.name} is not a JSON object")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not served (LORA is)")
    for key, neutral in (("bias", "none"), ("use_dora", False), ("modules_to_save", None), ("rank_pattern", {}),
                         ("alpha_pattern", {}), ("fan_in_fan_out", False)):  # fmt: skip
        value = config.get(key)
        if value is not None and value != neutral and value not in ([], {}):
            raise AdapterError(f"adapter_config.json: {key} {config.get(key)!r} is not served")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter_config.json: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"the adapter's rank {rank} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"adapter_config.json: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return rank, scaling


def read_factors(adapter: LoraAdapter, device: str = "cpu") -> None:
    """``adapter.factors`` read from its weights file (on the CPU numpy arrays, fp32 or fp16;
    elsewhere fp32 tensors on ``device``)."""
    weights_file = Path(adapter.path) / "adapter_model.safetensors"
    wanted = {f"{key}.{half}": entry for key, pair in adapter.layout.items() for half, entry in zip("AB", pair)}
    try:
        tensors = file_tensors(weights_file, wanted, adapter.file_id)
    except OSError as exc:
        raise unreadable(exc.strerror) from None
    for key in adapter.layout:
        a, b = tensors[f"{key}.A"], tensors[f"{key}.B"]
        if device != "cpu":
            a, b = torch.from_numpy(a.astype(np.float32)).to(device), torch.from_numpy(b.astype(np.float32)).to(device)
        adapter.factors[key] = (a, b)
