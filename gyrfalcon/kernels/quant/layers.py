"""Weight-only quantised layers over torch's own kernels: int4 (groups of 32) and int8 (per row).

The same classes serve every device torch has the kernel for: on the CPU
``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm``, on CUDA ``_weight_int4pack_mm``
(tinygemm, bf16 activations) and ``_weight_int8pack_mm`` where the build has it. Weights are
packed for the device once, at construction; a device without the kernel is refused with
:class:`UnsupportedQuantization`, never served by a slow fallback.

Activations stay in the model's dtype. Each output row depends on its own input row only (the
kernels tile rows independently: measured bit-identical alone and in batches up to 400), so a
request gets the same logits alone and inside any batch.

Every layer checks itself once when it is built: a probe row through the packed kernel must give
the product with the dequantised weights (within the input dtype's rounding), so a packing layout
that a torch build or device reads differently is refused at start-up, not served.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import weakref
from collections.abc import Callable, Iterator

import torch

from gyrfalcon.kernels.quant.weights import GROUP, Int4Weights, Int8Weights

#: torch's int4 kernels store ``(q - 8) * scale + zero``
_INT4_MIDPOINT = 8
#: CUDA's packing: inner K tiles of the tinygemm layout (K must divide by 16 × this)
_CUDA_INNER_K_TILES = 8


class UnsupportedQuantization(ValueError):
    """The requested quantisation has no kernel on this device, dtype or shape."""


def _has_kernel(op: str, device: torch.device) -> bool:
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    return key is not None and hasattr(torch.ops.aten, op) and torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key)


def int4_kernel(device: torch.device) -> str | None:
    """The int4 matmul op torch has for ``device``, None where it has none."""
    op = "_weight_int4pack_mm_for_cpu" if device.type == "cpu" else "_weight_int4pack_mm"
    return op if _has_kernel(op, device) else None


def int8_kernel(device: torch.device) -> str | None:
    """The int8 matmul op torch has for ``device``, None where it has none."""
    return "_weight_int8pack_mm" if _has_kernel("_weight_int8pack_mm", device) else None


def int4_fits(n: int, k: int, device: torch.device) -> bool:
    """Whether an ``[n, k]`` weight has a shape the int4 kernel takes on ``device``."""
    if device.type == "cuda":
        return n % 8 == 0 and k % (16 * _CUDA_INNER_K_TILES) == 0 and k % GROUP == 0
    return n % 16 == 0 and k % GROUP == 0


#: a layer's probe may differ from the dequantised product by this share of the product's norm
_PROBE_RTOL = {torch.float32: 1e-4}
_PROBE_DEFAULT_RTOL = 2e-2


def _flat(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).to(dtype).contiguous()


@torch.no_grad()
def _probe(layer: torch.nn.Module, reference: torch.Tensor, kind: str) -> None:
    """Refuse ``layer`` unless one probe row gives ``x @ referenceᵀ`` (``reference``: fp32 ``[N, K]``)."""
    device = next(layer.buffers()).device
    x = torch.randn(1, reference.shape[1], generator=torch.Generator().manual_seed(0)).to(device)
    want = x.to(layer.dtype).float() @ reference.to(device).t()
    got = layer(x).float() - (0 if layer.bias is None else layer.bias.float())
    error = float((got - want).norm() / want.norm().clamp_min(1e-30))
    if not error <= _PROBE_RTOL.get(layer.dtype, _PROBE_DEFAULT_RTOL):
        raise UnsupportedQuantization(f"the {kind} kernel on {device.type} does not reproduce its weights "
                                      f"(relative error {error:.3g} on a probe): refusing to serve it")  # fmt: skip


class Int4Linear(torch.nn.Module):
    """``y = x Wᵀ + b`` with ``W`` in int4 groups of 32, packed for ``device``; activations in ``dtype``."""

    def __init__(self, weights: Int4Weights, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        n, k = weights.shape
        op = int4_kernel(device)
        if op is None:
            raise UnsupportedQuantization(f"torch {torch.__version__} has no int4 weight-only kernel on {device.type}")
        if not int4_fits(n, k, device):
            raise UnsupportedQuantization(f"the int4 kernel on {device.type} does not take a [{n}, {k}] weight")
        if device.type == "cuda" and dtype != torch.bfloat16:
            raise UnsupportedQuantization("the CUDA int4 kernel (tinygemm) takes bfloat16 activations only")
        self.in_features, self.out_features = k, n
        self.dtype = dtype
        self._op = getattr(torch.ops.aten, op)
        q = weights.q.to(device)
        if device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        else:  # tinygemm packs two weights a byte, the even column in the high nibble
            packed = torch.ops.aten._convert_weight_to_int4pack((q[:, 0::2] << 4 | q[:, 1::2]).contiguous(),
                                                                _CUDA_INNER_K_TILES)  # fmt: skip
        scale = weights.scale.float()
        zero = weights.minimum.float() + _INT4_MIDPOINT * scale
        self.register_buffer("packed", packed)
        self.register_buffer("scale_and_zero", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype).to(device))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype).to(device))
        _probe(self, weights.dequantize(), "int4")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._op(_flat(x, self.dtype), self.packed, GROUP, self.scale_and_zero)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 g{GROUP}, {self.dtype}"


class Int8Linear(torch.nn.Module):
    """``y = x Wᵀ + b`` with ``W`` in int8 with one scale per output row; activations in ``dtype``."""

    def __init__(self, weights: Int8Weights, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if int8_kernel(device) is None:
            raise UnsupportedQuantization(f"torch {torch.__version__} has no int8 weight-only kernel on {device.type}")
        self.out_features, self.in_features = weights.shape
        self.dtype = dtype
        self.register_buffer("q", weights.q.to(device).contiguous())
        self.register_buffer("scale", weights.scale.to(dtype).to(device))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype).to(device))
        _probe(self, weights.dequantize(), "int8")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(_flat(x, self.dtype), self.q, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantised rows ``ids`` of ``W`` (a tied embedding's lookup)."""
        return self.q[ids].to(dtype) * self.scale[ids].unsqueeze(-1).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row, {self.dtype}"


def _device_of(module: torch.nn.Module) -> torch.device:
    return next(module.buffers()).device


class CastLinear(torch.nn.Module):
    """A dense ``y = x Wᵀ + b`` whose weight is kept (and multiplied) in ``dtype``, its output cast
    back to the input's dtype: the output head in bf16 beside an fp32 stream (AMX matmuls, half the
    bytes of fp32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.register_buffer("weight", weight.detach().to(dtype).to(device).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype).to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(self.dtype), self.weight, self.bias).to(x.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.weight[ids].to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dense {self.dtype}"


def packed_linear_kernel() -> bool:
    """Whether this torch build has oneDNN's linear over a reordered weight (CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(torch.nn.Module):
    """A dense fp32 ``y = x Wᵀ + b`` on the CPU through oneDNN, its weight reordered once for the
    kernel: the output head beside the int4 layers.

    Why not ``F.linear``: MKL's sgemm takes a different code path for one row, for a tail of two or
    three rows and for blocks of four, so a row's logits changed in the last bits with the number
    of rows beside it (up to 8e-5 on the default model's head), enough to flip a seeded sample now
    and then. oneDNN over the reordered weight gives each row the same bits at any row count and
    position (checked on the layer itself at construction: refused otherwise), and was faster here
    at every row count (5.0 against 10.7 ms at one row, 6.4 against 14.6 at sixteen, 2 threads).

    ``keep_weight``: ``weight`` stays the module's (a tied input embedding that reads the model's
    own tensor); otherwise only the reordered copy is kept — the kernel's, held outside the
    module's buffers (an opaque oneDNN tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_weight: bool = True) -> None:
        super().__init__()
        if not packed_linear_kernel() or weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise UnsupportedQuantization("the packed linear kernel takes fp32 weights on a CPU build with oneDNN")
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 16)
        self._key = next(_PACKED_KEYS)
        _PACKED[self._key] = self
        check_rows_alone(self, weight)
        if keep_weight:
            self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        if torch.compiler.is_compiling():
            y = _packed_linear(flat, self._key, self.out_features)
        else:
            y = self.product(flat)
        return y.reshape(*x.shape[:-1], self.out_features)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` ``[M, K]`` times the reordered weight (plus the bias)."""
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(flat, self._packed, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dense float32 (oneDNN, reordered)"


#: the live packed layers by key: a compiled step names its layer by a number (inductor cannot
#: take oneDNN's opaque weight as an input, and a graph break around the layer cost a second
#: guard check and region each step, about 1 ms on the default model). Keys count layers in the
#: order they are made, not ``id``s: the number is a constant of the compiled graph, and one that
#: changed from process to process missed inductor's cache every start
_PACKED: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_PACKED_KEYS = itertools.count()


@torch.library.custom_op("gyrfalcon::packed_linear", mutates_args=())
def _packed_linear(flat: torch.Tensor, layer: int, out_features: int) -> torch.Tensor:
    """:meth:`PackedLinear.product` of the layer whose key is ``layer``, as an operator a compiler calls as it is."""
    return _PACKED[layer].product(flat)


@_packed_linear.register_fake
def _(flat: torch.Tensor, layer: int, out_features: int) -> torch.Tensor:
    return flat.new_empty((flat.shape[0], out_features))


#: False while loading weights whose kernels and shapes have been probed already (:func:`probed_kernels`)
_PROBING: contextvars.ContextVar[bool] = contextvars.ContextVar("probing", default=True)


@contextlib.contextmanager
def probed_kernels() -> Iterator[None]:
    """Within it :func:`check_rows_alone` probes nothing: for weights loaded into the kernels and
    shapes of weights already served, which passed the probe at start-up (an update of the served
    weights, a sleep's wake; the probe was a third of such a load on the default model)."""
    token = _PROBING.set(False)
    try:
        yield
    finally:
        _PROBING.reset(token)


@torch.no_grad()
def check_rows_alone(layer: torch.nn.Module, weight: torch.Tensor | Callable[[], torch.Tensor], inputs=None,
                     rows: int = 7) -> None:  # fmt: skip
    """Refuse ``layer`` unless each row of a ``rows``-row probe gets the same bits alone, and its
    result agrees with the plain product with ``weight`` (of the inputs as ``inputs`` rounds them,
    where the kernel reads them rounded); nothing within :func:`probed_kernels`. ``weight`` may be
    a function that makes it (called only when probing: dequantising is a cost of its own)."""
    if not _PROBING.get():
        return
    weight = weight() if callable(weight) else weight
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(0))
    together = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
    want = torch.nn.functional.linear(x if inputs is None else inputs(x), weight, layer.bias)
    if not torch.equal(together, alone) or not torch.allclose(together, want, rtol=1e-4, atol=1e-4):
        raise UnsupportedQuantization(f"{type(layer).__name__}'s kernel gives a row other bits beside other rows, "
                                      "or a product its weights do not")  # fmt: skip


class TiedEmbedding(torch.nn.Module):
    """An input embedding that reads its rows from its tied output head (:class:`CastLinear`,
    :class:`Int8Linear` or :class:`~gyrfalcon.kernels.quant.q8.Q8Linear`: anything with
    ``rows(ids, dtype)``): one copy of the table, the lookup converting only the rows it gathers
    into the model's ``dtype``."""

    def __init__(self, head: torch.nn.Module, dtype: torch.dtype, padding_idx: int | None = None) -> None:
        super().__init__()
        self.head = [head]  # a list: not a submodule, so its buffers are not counted twice
        self.dtype = dtype
        self.padding_idx = padding_idx
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    @property
    def weight(self) -> torch.Tensor:
        """The table in the model's dtype (for code that inspects it; the forward never builds it)."""
        head = self.head[0]
        return head.rows(torch.arange(self.num_embeddings, device=_device_of(head)), self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head[0].rows(ids, self.dtype)


def _shared_rows(parts: list[torch.nn.Module], name: str, fused: torch.Tensor) -> None:
    """Make each part's tensor ``name`` a view of its rows of ``fused`` (so fusing costs no memory)."""
    offset = 0
    for part in parts:
        rows = getattr(part, name).shape[0]
        view = fused[offset : offset + rows]
        if isinstance(getattr(part, name), torch.nn.Parameter):
            setattr(part, name, torch.nn.Parameter(view, requires_grad=False))
        else:
            part._buffers[name] = view
        offset += rows
        if hasattr(part, "forget_tensors"):  # what a layer keeps of its old tensors (Q4Linear's kernel call) goes with them
            part.forget_tensors()


def _fused_bias(parts: list[torch.nn.Module], dtype: torch.dtype) -> torch.Tensor | None:
    biases = [part.bias for part in parts]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.to(dtype) if b is not None else torch.zeros(part.out_features, dtype=dtype, device=_device_of(part))
                      for b, part in zip(biases, parts)])  # fmt: skip


@torch.no_grad()
def fuse_outputs(parts: list[torch.nn.Module]) -> torch.nn.Module | None:
    """One layer whose output is ``torch.cat([part(x) for part in parts], -1)``, computed in one
    matmul (q/k/v, gate/up); the parts' weights become views of the fused ones (int4's
    scale-and-zero table, which torch's kernel takes contiguous with output rows on its second axis, is
    copied instead). None where the parts are not all dense ``Linear``/:class:`CastLinear`, or all
    :class:`Int4Linear`, all :class:`Int8Linear` or all of a kind with a ``fused_from`` class
    method (:class:`~gyrfalcon.kernels.quant.q4.Q4Linear`), of one input size and dtype.

    A kernel's packing may tie rows together (the CPU int4 layout packs blocks of 64 rows), so the
    fused layer must give the parts' outputs bit for bit on a probe, else None and the parts stay
    as they were."""
    kinds = {type(part) for part in parts}
    if len(kinds) != 1 or len({part.in_features for part in parts}) != 1:
        return None
    kind = kinds.pop()
    if hasattr(kind, "fused_from"):  # a layer that knows how to join its kind (q4.Q4Linear)
        fused, names = kind.fused_from(parts)
        return _share_if_exact(parts, fused, names)
    if kind in (torch.nn.Linear, CastLinear):
        if len({part.weight.dtype for part in parts}) != 1:
            return None
        dtype = parts[0].weight.dtype
        fused = CastLinear(torch.cat([part.weight for part in parts]), _fused_bias(parts, dtype), dtype, parts[0].weight.device)
        return _share_if_exact(parts, fused, ["weight"])
    if kind not in (Int4Linear, Int8Linear) or len({part.dtype for part in parts}) != 1:
        return None
    fused = kind.__new__(kind)
    torch.nn.Module.__init__(fused)
    first = parts[0]
    fused.in_features, fused.out_features, fused.dtype = first.in_features, sum(p.out_features for p in parts), first.dtype
    fused.register_buffer("bias", _fused_bias(parts, first.dtype))
    if kind is Int4Linear:
        fused._op = first._op
        fused.register_buffer("packed", torch.cat([part.packed for part in parts]))
        fused.register_buffer("scale_and_zero", torch.cat([part.scale_and_zero for part in parts], 1).contiguous())
        return _share_if_exact(parts, fused, ["packed"])
    fused.register_buffer("q", torch.cat([part.q for part in parts]))
    fused.register_buffer("scale", torch.cat([part.scale for part in parts]))
    return _share_if_exact(parts, fused, ["q", "scale"])


def _share_if_exact(parts: list[torch.nn.Module], fused: torch.nn.Module, names: list[str]) -> torch.nn.Module | None:
    """``fused`` with the parts' tensors ``names`` made views of it, if a probe gives the parts'
    outputs bit for bit (no probe within :func:`probed_kernels`: the served layers' fusion passed
    it); else None."""
    if _PROBING.get():
        device = _device_of(fused)
        probe = torch.randn(2, fused.in_features, generator=torch.Generator().manual_seed(0)).to(device)
        if not torch.equal(fused(probe), torch.cat([part(probe) for part in parts], -1)):
            return None
    for name in names:
        _shared_rows(parts, name, getattr(fused, name))
    return fused
