"""A GGUF's ``Q8_0`` table served as it is: the output head in fp32 logits through a small C kernel
(``q8_linear.c`` beside this module), and the tied input embedding looking up the same bits.

The kernel is compiled once per machine with its C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``; the compiled step's inductor needs one too), for the instruction set torch found
(AVX-512, AVX2, or portable vectors), with OpenMP where the compiler has it (else on one thread),
and kept in ``<cache>/kernels`` under a name that hashes its source, flags and compiler. Where no
compiler works the caller keeps its fp32 head
(:class:`~gyrfalcon.engine.model.quant.layers.PackedLinear`) and the start-up line says why.

Measured on the default model's head (49,152 × 576; 2 threads): 1.0 ms at one row against 5.3 for
the fp32 head through oneDNN, 2.1 against 4.9 at four rows, 6.3 against 6.5 at sixteen, 19.9
against 18.3 at sixty-four — a quarter of the bytes, and at large batches the same arithmetic.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from gyrfalcon.engine.model.quant.layers import UnsupportedQuantization, check_rows_alone
from gyrfalcon.engine.model.quant.weights import GROUP

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("q8_linear.c")

def _isa_flags() -> list[str]:
    """The instruction set torch chose for this CPU (its kernels' own dispatch), as compiler flags."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return ["-mavx512f", "-mavx512bw", "-mfma"]
    return ["-mavx2", "-mfma"] if capability == "AVX2" else []


class KernelUnavailable(UnsupportedQuantization):
    """The C kernel could not be built or loaded here (the message says why)."""


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise KernelUnavailable("no C compiler found ($CC, cc, gcc, clang)")


def _build(cache: Path) -> Path:
    """The kernel's shared library in ``cache``, compiled there if it is not yet: with OpenMP (it
    shares torch's libgomp), else — a compiler without it — on the calling thread alone."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    failure = KernelUnavailable(f"{cc} built nothing")
    for threads in (["-fopenmp"], []):
        try:
            return _compile(cc, version, ["-O3", "-shared", "-fPIC", "-ffp-contract=fast", *threads, *_isa_flags()], cache)
        except KernelUnavailable as error:
            failure = error
    raise failure


def _compile(cc: str, version: str, flags: list[str], cache: Path) -> Path:
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), *flags, version]).encode()).hexdigest()[:16]
    target = cache / f"q8_linear-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    fd, partial = tempfile.mkstemp(dir=cache, suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", partial, str(_SOURCE)], capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelUnavailable(f"{cc} {' '.join(flags)} failed: {done.stderr.strip()[-300:]}")
        os.replace(partial, target)  # atomic: a second process building beside this one loses nothing
        log.info("built %s (%s) in %.1f s", target.name, " ".join(flags), time.perf_counter() - start)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def _library(cache: Path) -> ctypes.CDLL:
    try:
        path = _build(cache)
    except OSError:  # a cache that cannot be written: build in a folder of our own
        path = _build(Path(tempfile.mkdtemp(prefix="gyrfalcon-kernels-")))
    library = ctypes.CDLL(str(path))  # ctypes drops the GIL for the call
    library.q8_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    library.q8_linear.restype = ctypes.c_int
    _loaded[:] = [library]
    return library


#: the kernel this process loaded (one: its bits are the head's, whatever layer calls it)
_loaded: list[ctypes.CDLL] = []


def q8_library(cache: Path | None) -> ctypes.CDLL:
    """The loaded kernel (built into ``cache`` at its first use, or into a temporary folder where
    ``cache`` is None); :class:`KernelUnavailable` if it cannot be."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT" and os.uname().machine == "x86_64":
        raise KernelUnavailable("this x86 CPU has neither AVX2 nor AVX-512")
    return _library(cache or Path(tempfile.gettempdir()) / f"gyrfalcon-kernels-{os.getuid()}")


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` in memory of its own: the bits are read from a memory-mapped file, and a view kept
    alive kept the whole file mapped and resident (91 MiB on the default model, for 31 of its table)."""
    return t.clone(memory_format=torch.contiguous_format)


def q8_rows(q8: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the table dequantised (``scale * q8`` per block of 32, in fp32: exact)."""
    q = q8[ids].reshape(*ids.shape, -1, GROUP).float()
    return (scale[ids].float()[..., None] * q).reshape(*ids.shape, q8.shape[1]).to(dtype)


class Q8Embedding(torch.nn.Module):
    """An input embedding kept as a GGUF's ``Q8_0`` table — ``q8`` ``[N, K]`` int8 and ``scale8``
    ``[N, K // 32]`` fp16, ``w = scale8 * q8`` per block of 32 — whose lookup dequantises only the
    rows it gathers, in the conversion's operation order: the same fp32 values as the dequantised
    table, in a quarter of its bytes (so a tied fp32 head need not keep that table for it)."""

    def __init__(self, q8: torch.Tensor, scale8: torch.Tensor, dtype: torch.dtype, padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = q8.shape
        self.dtype = dtype
        self.padding_idx = padding_idx
        self.register_buffer("q8", _own(q8))
        self.register_buffer("scale8", _own(scale8))

    @property
    def weight(self) -> torch.Tensor:
        """The whole table in ``dtype`` (for code that inspects it; the forward never builds it)."""
        return self(torch.arange(self.num_embeddings, device=self.q8.device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return q8_rows(self.q8, self.scale8, ids, self.dtype)


class Q8Linear(torch.nn.Module):
    """An fp32 ``y = x Wᵀ + b`` on the CPU over a ``Q8_0`` table — ``q8`` ``[N, K]`` int8, ``scale``
    ``[N, K // 32]`` — read as it is by ``q8_linear.c``: the output head beside the int4 layers.
    ``rows`` serves a tied input embedding from the same bits (:class:`~gyrfalcon.engine.model.quant.layers.TiedEmbedding`)."""

    def __init__(self, q8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, cache: Path | None) -> None:
        super().__init__()
        self.out_features, self.in_features = q8.shape
        if self.in_features % GROUP:
            raise KernelUnavailable(f"a Q8_0 table's rows are whole blocks of {GROUP}")
        q8_library(cache)
        self.register_buffer("q8", _own(q8))
        self.register_buffer("scale", _own(scale.float()))
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        check_rows_alone(self, q8_rows(self.q8, self.scale, torch.arange(self.out_features), torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        # eager calls the kernel directly (the operator's dispatch costs about 10 µs); compiled, the
        # operator keeps the head inside the graph
        product = _q8_linear if torch.compiler.is_compiling() else _product
        y = product(flat, self.q8, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantised rows ``ids`` of ``W`` (a tied embedding's lookup)."""
        return q8_rows(self.q8, self.scale, ids, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q8_0 table, float32 logits"


def _product(flat: torch.Tensor, q8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``flat`` ``[M, K]`` times the table's transpose, ``[M, N]`` fp32."""
    if flat.device.type != "cpu" or flat.shape[-1] != q8.shape[1]:
        raise ValueError(f"q8_linear takes [M, {q8.shape[1]}] CPU rows, got {list(flat.shape)} on {flat.device}")
    flat = flat.float().contiguous()  # the kernel reads raw fp32 rows (a no-op for the layer's own calls)
    out = torch.empty(flat.shape[0], q8.shape[0])
    if flat.shape[0]:
        assert _loaded, "a Q8Linear loads the kernel before its first product"
        status = _loaded[0].q8_linear(flat.data_ptr(), q8.data_ptr(), scale.data_ptr(), out.data_ptr(),
                                      flat.shape[0], q8.shape[0], q8.shape[1], torch.get_num_threads())  # fmt: skip
        if status:
            raise MemoryError("q8_linear could not allocate its per-thread buffer")
    return out


@torch.library.custom_op("gyrfalcon::q8_linear", mutates_args=())
def _q8_linear(flat: torch.Tensor, q8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The head's product (``_product``), as an operator a compiler calls as it is."""
    return _product(flat, q8, scale)


@_q8_linear.register_fake
def _(flat: torch.Tensor, q8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return flat.new_empty((flat.shape[0], q8.shape[0]))
