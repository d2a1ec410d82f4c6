"""New weights without a restart, as an RL trainer pushes them (SGLang's ``update_weights_from_disk``).

A folder of the served model's architecture (or a GGUF of its shape) is loaded exactly as the
served weights were — the same dtype, device, ``--quantization`` and matmul inputs, the same fused
q/k/v and gate/up layers (a converted GGUF in int4 packed from its bits straight into memory laid
out as the served one: :mod:`gyrfalcon.engine.restage`) — into tensors of its own, and every
tensor is held against the served one (name, shape, dtype) before anything changes: a mismatch is a 400 naming it, and the served
weights stay as they are. The engine's step loop then copies the staged tensors into the served
ones between two steps (:meth:`StagedWeights.apply`): in place, so the decode path's compiled step,
captured graphs and native layer loop, which hold the served tensors' memory, compute with the
new values at their next call. Until the copy the staged weights take memory of their own (their
size once more); it is released with them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gyrfalcon.engine_api.config import EngineConfig
from gyrfalcon.engine.model.decoder import fused_parts
from gyrfalcon.engine.restage import restage
from gyrfalcon.engine_api.errors import EngineUnavailable
from gyrfalcon.errors import Kind, RequestError
from gyrfalcon.kernels.quant.layers import fuse_outputs, probed_kernels
from gyrfalcon.models.default import resolve_model
from gyrfalcon.models.loading import load_weights

#: the weight version of the weights a server starts with (SGLang's)
FIRST_VERSION = "default"


@dataclass
class StagedWeights:
    """Loaded and checked weights, each beside the served tensor it replaces, and their version."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    version: str
    #: where they were loaded from (a level-2 sleep's wake loads them from there again)
    path: str = ""
    #: the prefix cache forgets every block when they are copied in
    flush_cache: bool = True

    @torch.no_grad()
    def apply(self) -> None:
        """Copy every staged tensor into the served one (between two steps: the step loop's thread),
        each byte once: a tensor whose memory is rows of another's (a fused layer's parts), served
        and staged alike, is copied with it."""
        for served, staged in _outermost(self.pairs):
            served.copy_(staged)
        self.pairs = []


def _span(tensor: torch.Tensor) -> tuple[int, int, int]:
    """``tensor``'s block of memory and the byte range it covers there (a contiguous tensor)."""
    start = tensor.storage_offset() * tensor.element_size()
    return tensor.untyped_storage().data_ptr(), start, start + tensor.nbytes


def _outermost(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (served, staged) pairs less those lying inside another pair at the same offset on both
    sides (contiguous tensors only; of two that cover the same bytes, the first is kept)."""
    spans = [(_span(s), _span(t)) if s.is_contiguous() and t.is_contiguous() else None for s, t in pairs]
    by_block: dict[int, list[int]] = {}
    for i, span in enumerate(spans):
        if span is not None:
            by_block.setdefault(span[0][0], []).append(i)

    def inside(i: int, j: int) -> bool:  # pair i lies within pair j
        (sb, s0, s1), (tb, t0, t1) = spans[i]
        (_, o0, o1), (ob, u0, u1) = spans[j]
        return tb == ob and o0 <= s0 and s1 <= o1 and s0 - o0 == t0 - u0 and (s0, s1) != (o0, o1) or (
            (s0, s1) == (o0, o1) and tb == ob and t0 == u0 and j < i)  # fmt: skip

    dropped = {i for group in by_block.values() for i in group if any(inside(i, j) for j in group if j != i)}
    return [pair for i, pair in enumerate(pairs) if i not in dropped]


def served_tensors(model: Any, layers: list[Any]) -> dict[str, torch.Tensor]:
    """Every tensor the served weights are made of, by name: the model's own, and the fused
    projections of ``layers`` (the direct forward's, ``engine.model.decoder._Layer``; their parts'
    tensors may be views of them, but not every kernel's are)."""
    tensors = dict(model.state_dict(keep_vars=True))
    for i, layer in enumerate(layers):
        for name in ("qkv", "gate_up"):
            fused = getattr(layer, name)
            if fused is not None:
                tensors.update({f"fused.{i}.{name}.{key}": t for key, t in fused.state_dict(keep_vars=True).items()})
    return tensors


def _fused_like(model: Any, layers: list[Any]) -> dict[str, torch.Tensor]:
    """A freshly loaded model's tensors as :func:`served_tensors` names them, its projections fused
    wherever the served ones are."""
    tensors = dict(model.state_dict(keep_vars=True))
    for i, (layer, served) in enumerate(zip(model.model.layers, layers)):
        for name, modules in fused_parts(layer).items():
            if getattr(served, name) is None:
                continue
            fused = fuse_outputs(modules)
            if fused is None:
                raise RequestError(f"layer {i}'s {name} projections of these weights cannot be fused as the served ones are",
                                   "model_path")  # fmt: skip
            tensors.update({f"fused.{i}.{name}.{key}": t for key, t in fused.state_dict(keep_vars=True).items()})
    return tensors


def _describe(tensor: torch.Tensor) -> str:
    return f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def stage(model: Any, layers: list[Any], path: str, version: str, cfg: EngineConfig, device: str,
          quantization: str) -> StagedWeights:  # fmt: skip
    """The weights at ``path`` loaded as the served ones (``model``'s, and its fused ``layers``':
    :func:`served_tensors`) were, and checked against them; a :class:`RequestError` naming
    ``model_path`` (the runtime rule ``model_path_fits``) for a path that is not there (a 404), is
    not a model, does not load, or whose tensors differ from the served ones in name, shape or dtype.
    A converted GGUF served in int4 is packed straight into memory laid out as the served one
    (:func:`~gyrfalcon.engine.restage.restage`) where it matches exactly; anything else is loaded
    as start-up loads it."""
    if not os.path.exists(path):
        raise RequestError(f"'{path}' does not exist on the server", "model_path", type=Kind.NOT_FOUND)
    if not (os.path.isdir(path) or (path.endswith(".gguf") and os.path.isfile(path))):
        raise RequestError(f"'{path}' is neither a model folder nor a .gguf file", "model_path")
    served = served_tensors(model, layers)
    inputs = None if cfg.matmul_inputs == "auto" else getattr(torch, cfg.matmul_inputs)
    try:
        folder = resolve_model(path, cfg.cache_dir)
        staged = restage(model, layers, served, folder)
        if staged is None:
            with probed_kernels():  # the served layers' kernels, shapes and fusions passed the probe at start-up
                # the step loop releases what the load freed once the copy is in
                loaded, _ = load_weights(folder, cfg.dtype, device, quantization, cfg.cache_dir, inputs, release=False)
                staged = _fused_like(loaded, layers) if layers else dict(loaded.state_dict(keep_vars=True))
    except RequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the folder holds, the client hears why it cannot serve
        raise RequestError(f"the weights at '{path}' cannot be loaded: {type(exc).__name__}: {exc}", "model_path") from None
    for name, tensor in served.items():
        other = staged.get(name)
        if other is None:
            raise RequestError(f"the weights at '{path}' have no tensor {name}", "model_path")
        if other.shape != tensor.shape or other.dtype != tensor.dtype:
            raise RequestError(f"tensor {name} is {_describe(other)} in the weights at '{path}', {_describe(tensor)} "
                               "in the served ones", "model_path")  # fmt: skip
    extra = sorted(set(staged) - set(served))
    if extra:
        raise RequestError(f"the weights at '{path}' have tensors the served model has not: {', '.join(extra[:3])}",
                           "model_path")  # fmt: skip
    return StagedWeights([(tensor, staged[name].detach()) for name, tensor in served.items()], version, path)


class WeightUpdates:
    """The served weights' version, and the update waiting for the step loop: one at a time, its
    caller waiting until the loop has copied it in (:meth:`push`), the loop taking it between two
    steps (:meth:`take`, then :meth:`applied`). ``source``: where the served weights came from."""

    def __init__(self, source: str) -> None:
        self.version = FIRST_VERSION
        self.source = source
        self._pending: StagedWeights | None = None
        self._applied = threading.Event()
        self._one_at_a_time = threading.Lock()
        self._updates = 0

    def push(self, stage: Callable[[str], StagedWeights], version: str | None, wake: Callable[[], None],
             timeout: float) -> str:  # fmt: skip
        """Stage the weights (``stage(version)``; an unnamed update is ``update-N``) and wait until the
        step loop has applied them (``wake`` wakes it); their version."""
        with self._one_at_a_time:
            self._updates += 1
            return self._hand(stage(version or f"update-{self._updates}"), wake, timeout)

    def reload(self, stage: Callable[[str, str], StagedWeights], wake: Callable[[], None], timeout: float) -> None:
        """The served weights loaded again from :attr:`source` (``stage(path, version)``) and copied
        in under their own version (a level-2 sleep's wake: their memory was handed back)."""
        with self._one_at_a_time:
            self._hand(stage(self.source, self.version), wake, timeout)

    def _hand(self, staged: StagedWeights, wake: Callable[[], None], timeout: float) -> str:
        self._applied.clear()
        self._pending = staged
        wake()
        if not self._applied.wait(timeout):
            self._pending = None
            raise EngineUnavailable(f"the step loop did not take the new weights within {timeout:.0f} s")
        return staged.version

    def take(self) -> StagedWeights | None:
        """The update waiting to be applied, no longer waiting (the step loop, between two steps)."""
        staged, self._pending = self._pending, None
        return staged

    def applied(self, staged: StagedWeights) -> None:
        self.version, self.source = staged.version, staged.path or self.source
        self._applied.set()
