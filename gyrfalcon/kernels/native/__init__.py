"""The engine's own C kernels (the ``*.c`` files of this folder), built into one shared library
and called through ctypes (which drops the GIL for the call); they need no torch headers.

- ``q8_linear.c``: the fp32 product with a GGUF's ``Q8_0`` table (the output head,
  :mod:`~gyrfalcon.kernels.quant.q8`);
- ``q4q8_linear.c`` and ``q4_linear.c``: the product of int4 weights in groups of 32, a GGUF's
  ``Q4_1`` blocks, with inputs rounded to int8 or to 15 bits (two int8 parts) per block of 32, or
  kept in fp32 (the decoder's linear layers,
  :mod:`~gyrfalcon.kernels.quant.q4`);
- ``mean_square.c``: an RMSNorm's mean of squares (:mod:`~gyrfalcon.engine.model.decoder`);
- ``one_query_attention.c``: a decode row's attention over its KV blocks, read in place, and
  ``prefill_attention.c``: a prefill's groups of rows over theirs
  (:mod:`~gyrfalcon.engine.model.one_query`);
- ``lora_add.c``: the LoRA adapters' products of a step's rows (:mod:`~gyrfalcon.engine.lora.step`),
  and an adapter's factors laid into its slot of the stacks, from memory or straight from its file
  (:mod:`~gyrfalcon.engine.lora.registry`);
- ``decode_layers.c``: every decoder layer of a step of decode rows in one call, through the
  kernels above (:mod:`~gyrfalcon.engine.model.layer_loop`).

Each wrapper becomes an operator a compiled step calls as it is through :func:`operator`.

Each computes every output in one fixed order whatever the rows beside it, so a row gets the same bits
alone and in any batch, eagerly and inside a compiled step.

The library is compiled once per machine with its C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``; the compiled step's inductor needs one too), for the instruction set torch found
(AVX-512, AVX2, or portable vectors), with OpenMP where the compiler has it (else on one thread),
and kept in ``<cache>/kernels`` under a name that hashes its sources, flags and compiler (about
0.3 s the first time). A library is loaded only from a folder and file of this user's that no one
else may write (made 0700); anything else is built again in a new private temporary folder. Where no compiler works, :func:`library` raises :class:`KernelUnavailable`
and the callers keep torch's kernels (the start-up line says so).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from gyrfalcon.kernels.native.cpu import cpu

log = logging.getLogger(__name__)

_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
#: what the sources include (in the library's name too: a change rebuilds it)
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_POINTER, _LONG, _INT = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
#: each kernel's C signature: (argument types, result type)
_SIGNATURES = {
    "q8_linear": ([_POINTER] * 4 + [_LONG] * 3 + [_INT], _INT),
    "q4_linear": ([_POINTER] * 4 + [_LONG] * 3 + [_INT], _INT),
    "q4q8_linear": ([_POINTER] * 4 + [_LONG] * 3 + [_INT], _INT),
    "q4q16_linear": ([_POINTER] * 4 + [_LONG] * 3 + [_INT], _INT),
    "mean_square": ([_POINTER] * 2 + [_LONG] * 2 + [_INT], _INT),
    "one_query_attention": ([_POINTER] * 6 + [_LONG] * 7 + [ctypes.c_float, _INT, _INT], _INT),
    "prefill_attention": ([_POINTER] * 6 + [_LONG] * 7 + [ctypes.c_float, _INT, _INT], _INT),
    "decode_layers": ([_POINTER, _LONG, _POINTER] + [_LONG] * 6 + [_POINTER] * 3 + [_LONG] * 2 + [_POINTER] * 2
                      + [ctypes.c_float] * 2 + [_INT] * 2 + [_POINTER] * 2 + [_LONG] * 2 + [_INT], _INT),
    "lora_add": ([_POINTER, _LONG] + [_POINTER] * 4 + [_LONG] * 6 + [_INT], _INT),
    "silu_mul": ([_POINTER] * 3 + [_LONG], None),
    "q4_pack_nibbles": ([_POINTER] * 2 + [_LONG] * 2 + [_INT], _INT),
    "q4_pack_scales": ([_POINTER] * 3 + [_LONG] * 2, _INT),
    "q8_pack_panels": ([_POINTER] * 2 + [_LONG] * 2 + [_INT], _INT),
    "lora_pack": ([_LONG] + [_POINTER] * 6 + [_LONG] * 3 + [ctypes.c_float, _INT], _INT),
    "lora_read": ([_INT, _LONG] + [_POINTER] * 6 + [_LONG] * 3 + [ctypes.c_float, _INT], _INT),
}


#: the threads that step an engine (:func:`stepping`): only they open OpenMP teams of these kernels
_STEPPERS: set[int] = set()


@contextlib.contextmanager
def stepping() -> Iterator[None]:
    """Mark the calling thread as one that steps an engine (its load, warm-up and step loop) for
    the time of the block: :func:`threads`."""
    me = threading.get_ident()
    _STEPPERS.add(me)
    try:
        yield
    finally:
        _STEPPERS.discard(me)


def threads() -> int:
    """The threads a kernel called now may run on: torch's count on a thread that steps an engine
    (:func:`stepping`), or anywhere while none does (a benchmark, a test); one elsewhere. An OpenMP
    team opened by another thread (a weight swap's, an adapter load's, a background compile's)
    leaves threads that libgomp counts from then on, so it throttles the spinning at the step loop's
    own barriers: measured on 2 cores (default model, c=16, requests over 4 adapters), 0.52-0.66x
    the base model after adapter loads packed on 2 threads, 0.83x on one."""
    return torch.get_num_threads() if not _STEPPERS or threading.get_ident() in _STEPPERS else 1


class KernelUnavailable(RuntimeError):
    """The C kernels could not be built or loaded here (the message says why)."""


def _isa_flags() -> list[str]:
    """The instruction set torch chose for this CPU (its kernels' own dispatch, :mod:`.cpu`), as compiler flags."""
    here = cpu()
    if here.avx512:
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c", *(["-mavx512vnni"] if here.vnni else [])]
    return ["-mavx2", "-mfma", "-mf16c"] if here.avx2 else []


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise KernelUnavailable("no C compiler found ($CC, cc, gcc, clang)")


def _build(cache: Path) -> Path:
    """The shared library in ``cache``, compiled there if it is not yet: with OpenMP (it shares
    torch's libgomp), else — a compiler without it — on the calling thread alone."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    failure = KernelUnavailable(f"{cc} built nothing")
    for threads in (["-fopenmp"], []):
        try:
            return _compile(cc, version, ["-O3", "-shared", "-fPIC", "-ffp-contract=fast", *threads, *_isa_flags()], cache)
        except KernelUnavailable as error:
            failure = error
    raise failure


def _private(path: Path) -> bool:
    """Whether ``path`` is this user's and nobody else may write it (a library loaded from there
    runs as this process: another local user must not have been able to plant or change it)."""
    info = path.lstat()
    return info.st_uid == os.getuid() and not info.st_mode & 0o022 and not path.is_symlink()


def _private_folder(folder: Path) -> Path:
    """``folder``, made (0700) if it is not there; a PermissionError unless it is :func:`_private`."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _private(folder):
        raise PermissionError(f"{folder} is another user's or writable by others")
    return folder


def _compile(cc: str, version: str, flags: list[str], cache: Path) -> Path:
    sources = [f"{path.name}\0{path.read_text()}" for path in (*_SOURCES, *_HEADERS)]
    key = hashlib.sha256("\0".join([*sources, *flags, version]).encode()).hexdigest()[:16]
    target = _private_folder(cache) / f"kernels-{key}.so"
    if target.exists() or target.is_symlink():
        if _private(target):
            return target
        log.warning("%s is another user's or writable by others: built again in a folder of our own", target)
        cache = Path(tempfile.mkdtemp(prefix="gyrfalcon-kernels-"))
        target = cache / target.name
    start = time.perf_counter()
    fd, partial = tempfile.mkstemp(dir=cache, suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", partial, *map(str, _SOURCES)], capture_output=True, text=True)
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
    except OSError:  # a cache that cannot be written, or is not private: build in a folder of our own
        path = _build(Path(tempfile.mkdtemp(prefix="gyrfalcon-kernels-")))
    library = ctypes.CDLL(str(path))
    for name, (arguments, result) in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, result
    if not _loaded:
        _loaded.append(library)
    return library


#: the library this process serves with (the first one loaded: every caller must compute the
#: same bits as every other, whichever cache folder it was given)
_loaded: list[ctypes.CDLL] = []


def library(cache: Path | None) -> ctypes.CDLL:
    """The kernels, built into ``cache`` at their first use (into a temporary folder where
    ``cache`` is None); :class:`KernelUnavailable` if they cannot be."""
    if not cpu().avx2 and os.uname().machine == "x86_64":
        raise KernelUnavailable("this x86 CPU has neither AVX2 nor AVX-512")
    _library(cache or Path(tempfile.gettempdir()) / f"gyrfalcon-kernels-{os.getuid()}")
    return _loaded[0]


def loaded() -> ctypes.CDLL | None:
    """The library this process loaded (None before :func:`library` succeeds)."""
    return _loaded[0] if _loaded else None


_OPERATORS = torch.library.Library("gyrfalcon", "FRAGMENT")


def operator(schema: str, kernel, fake) -> torch._ops.OpOverload:
    """``kernel`` (a Python wrapper of one of these kernels) as the operator ``gyrfalcon::<schema>``,
    which a compiled step calls as it is — so compiled and eager steps compute the same bits —
    ``fake`` giving its outputs' shapes to the compiler. Defined through ``torch.library.Library``,
    whose dispatch costs about 4 µs a call against 8 for ``custom_op``'s; a call still costs some
    7 µs in all, which is why a compiled step sums the norms' squares in fused operations instead."""
    name = schema.split("(", 1)[0]
    _OPERATORS.define(schema)
    _OPERATORS.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"gyrfalcon::{name}")(fake)
    return getattr(torch.ops.gyrfalcon, name).default
