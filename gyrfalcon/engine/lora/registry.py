"""The adapters an engine serves, by name, as vLLM keeps them: every adapter loaded is known (its
folder checked against the served layers when it is loaded, :func:`~gyrfalcon.engine.lora.peft.read_adapter`),
and a fixed number of slots hold the ones requests run with — ``max(--max-loras,
--max-cpu-loras)`` of them and one more. A slot is a place in every projection's stacked factors,
``A`` ``[slots · r, in]`` and ``B`` transposed ``[slots · r, out]`` with the adapter's scaling in it
(a slot's rows whole, for ``lora_add.c``), ``r`` the largest rank, zeros past an adapter's own, so
that a step computes every row's adapter product for a projection in one call
(:mod:`~gyrfalcon.engine.lora.step`).

A request's adapter takes a slot when the scheduler admits it (:meth:`LoraRegistry.acquire`): read
back from its folder where no slot holds it, into a free slot or the one of the adapter used least
recently that no running request holds; with none, the request waits. An adapter unloaded or
replaced keeps its slot while requests still run with it."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from gyrfalcon.engine.lora.peft import (AdapterError, LoraAdapter, changed, check_identity, read_adapter,
                                        read_factors, unreadable, warm_checks)
from gyrfalcon.kernels.native import loaded, threads


class _StackTable(NamedTuple):
    """Every projection's stacks as ``lora_pack`` and ``lora_read`` take them, in one order: their
    keys, the addresses of ``A`` and ``Bᵀ``, and their widths (``in`` and ``out``)."""

    keys: list[tuple[int, str]]
    a: np.ndarray
    bt: np.ndarray
    ins: np.ndarray
    outs: np.ndarray


def _fp32(pair: tuple[Any, Any]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A pair of factors as contiguous fp32 numpy arrays (as read, where they are already)."""
    return tuple(None if f is None else np.ascontiguousarray(f, dtype=np.float32) for f in pair)  # type: ignore[return-value]


def projection_shapes(layers: list[Any]) -> dict[tuple[int, str], tuple[int, int]]:
    """``(layer, module)`` → ``(out, in)`` of every projection of the direct forward's ``layers``."""
    shapes = {}
    for i, layer in enumerate(layers):
        for owner, names in ((layer.attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                             (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):  # fmt: skip
            for name in names:
                module = getattr(owner, name)
                shapes[(i, name)] = (int(module.out_features), int(module.in_features))
    return shapes


class LoraRegistry:
    """Adapters by name (see the module docstring); safe to read from the step loop while another
    thread loads or unloads one."""

    def __init__(self, shapes: dict[tuple[int, str], tuple[int, int]], max_loras: int, max_rank: int,
                 device: torch.device | str, max_cpu_loras: int | None = None) -> None:  # fmt: skip
        self.shapes, self.max_loras, self.max_rank, self.device = shapes, max_loras, max_rank, str(device)
        self.slots = max(max_loras, max_cpu_loras or 0) + 1
        #: per ``(layer, module)``: the stacked ``A`` and (scaled) ``Bᵀ`` of every slot
        self.stacks = {key: (torch.zeros(self.slots * max_rank, columns, device=device),
                             torch.zeros(self.slots * max_rank, rows, device=device))
                       for key, (rows, columns) in shapes.items()}  # fmt: skip
        #: the projections some adapter held (or retired) has factors for: the others are left alone
        self.active: set[tuple[int, str]] = set()
        self._known: dict[str, str] = {}  # every adapter loaded: its folder, by name (vLLM's lora_requests)
        self._adapters: dict[str, LoraAdapter] = {}  # those a slot holds, by name
        self._owners: dict[int, LoraAdapter] = {}  # each slot's adapter (held, or unloaded or replaced)
        self._used: dict[int, int] = {}  # each slot's last acquisition (the least recent is given up first)
        self._lock = threading.Lock()
        self._loads = 0
        self._ticks = 0
        self._targets: _StackTable | None = None  # the stacks' addresses and widths, for lora_pack and lora_read
        self._reserved: set[int] = set()  # slots a load is filling
        # tables of the model, not of an adapter, and the header's checks run once: now rather
        # than in the first load
        self._stack_targets()
        warm_checks(shapes)

    def load(self, name: str, path: str, replace: bool = False, in_use: frozenset[int] = frozenset()) -> LoraAdapter:
        """Read, check and know the adapter of ``path`` as ``name`` (``replace``: in place of one of
        that name), in a slot if one is free (else it takes one when a request needs it); an
        :class:`AdapterError` when it cannot serve or its name is taken, nothing changed then.
        ``in_use``: the serials of the adapters requests hold."""
        self._check_name(name, replace)
        adapter = read_adapter(name, path, self.shapes, self.max_rank, self.device, factors=False)
        with self._lock:
            self._check_name(name, replace)
            slot = self._reserve(in_use, evict=False)
        self._fill(adapter, slot)
        with self._lock:
            self._reserved.discard(slot)
            self._check_name(name, replace)  # (a load of the same name meanwhile: its slot is free again)
            self._known[name] = path
            self._adapters.pop(name, None)  # (a replaced adapter keeps its slot while requests hold it)
            if slot is not None:
                self._place(adapter, slot)
        return adapter

    def acquire(self, name: str, in_use: frozenset[int]) -> LoraAdapter | None:
        """The adapter ``name`` in a slot (read back from its folder where none holds it, into a free
        slot or the least recently used one whose adapter no running request holds: ``in_use``, their
        serials); None when every slot is in use (the request waits); an :class:`AdapterError` when
        the name is not known or its folder no longer serves."""
        with self._lock:
            held = self._adapters.get(name)
            if held is not None:
                self._touch(held.slot)
                return held
            if name not in self._known:
                raise AdapterError(f"The lora adapter '{name}' cannot be found.", "model", found=False)
            if self._free_slot(in_use, evict=True, take=False) is None:
                return None
            path = self._known[name]
        # checked before a slot is taken (a folder that no longer serves evicts nothing), then read
        adapter = read_adapter(name, path, self.shapes, self.max_rank, self.device, factors=False)
        with self._lock:
            slot = self._reserve(in_use, evict=True)
        if slot is None:
            return None
        self._fill(adapter, slot)
        with self._lock:
            self._reserved.discard(slot)
            if self._known.get(name) != path:  # unloaded or replaced meanwhile: asked again next step
                return None
            held = self._adapters.get(name)
            if held is not None:  # (placed by a load meanwhile)
                self._touch(held.slot)
                return held
            self._place(adapter, slot)
            self._touch(slot)
            return adapter

    def _reserve(self, in_use: frozenset[int], evict: bool) -> int | None:
        """(Under the lock) :meth:`_free_slot` taken and kept from every other load until this one
        has filled it (:meth:`_fill`) and placed its adapter, or let it go."""
        slot = self._free_slot(in_use, evict)
        if slot is not None:
            self._reserved.add(slot)
        return slot

    def _free_slot(self, in_use: frozenset[int] | set[int], evict: bool, take: bool = True) -> int | None:
        """(Under the lock) a slot no adapter holds, else one of an unloaded or replaced adapter no
        request holds, else (``evict``) the least recently used one of a held adapter no running
        request holds, given up (``take``); None when there is none. A reserved slot is none of these."""
        free = [slot for slot in range(self.slots) if slot not in self._owners and slot not in self._reserved]
        if free:
            return free[0]
        idle = [slot for slot, owner in self._owners.items() if owner.serial not in in_use]
        retired = [slot for slot in idle if self._adapters.get(self._owners[slot].name) is not self._owners[slot]]
        if retired:
            slot = retired[0]
        elif evict and idle:
            slot = min(idle, key=lambda s: self._used.get(s, 0))
        else:
            return None
        if take:
            owner = self._owners.pop(slot)
            if self._adapters.get(owner.name) is owner:
                del self._adapters[owner.name]  # still known: read back when a request needs it
        return slot

    def _fill(self, adapter: LoraAdapter, slot: int | None) -> None:
        """The reserved ``slot`` (no row's: no step reads it) filled with ``adapter``'s factors; on
        failure the slot is let go and an :class:`AdapterError` raised."""
        if slot is None:
            return
        adapter.slot = slot
        try:
            if self.device == "cpu" and self._read_into_slot(adapter):
                return
            read_factors(adapter, self.device)
            self._write(adapter)
            adapter.factors = {}  # (the stacks hold them now: not twice in memory)
        except BaseException as exc:
            with self._lock:
                self._reserved.discard(slot)
            if isinstance(exc, AdapterError) or not isinstance(exc, Exception):
                raise
            # (the step loop admits requests through here: what fails is the request's, not the loop's)
            raise unreadable(f"{type(exc).__name__}: {exc}") from None

    def _place(self, adapter: LoraAdapter, slot: int) -> None:
        """(Under the lock) ``adapter``, filled into ``slot`` (no adapter's now), held by name."""
        self._loads += 1
        adapter.serial, adapter.slot, adapter.stacks, adapter.active = self._loads, slot, self.stacks, self.active
        adapter.columns = (slot * self.max_rank, (slot + 1) * self.max_rank)
        self.active.update(adapter.layout)
        self._owners[slot] = adapter
        self._adapters[adapter.name] = adapter

    def _touch(self, slot: int) -> None:
        self._ticks += 1
        self._used[slot] = self._ticks

    @torch.no_grad()
    def _write(self, adapter: LoraAdapter) -> None:
        """The adapter's factors into its slot of every projection's stacks (zeros where it has none),
        the scaling multiplied in as ``B`` is transposed: on the CPU in one call of ``lora_pack``
        (``lora_add.c``, the layout's owner), else one pass over them. The slot is no row's: no step
        reads it meanwhile."""
        if self.device == "cpu" and self._pack(adapter):
            return
        first, rank, end = adapter.slot * self.max_rank, adapter.rank, (adapter.slot + 1) * self.max_rank
        scaling = np.float32(adapter.scaling)
        for key, (a_stack, bt_stack) in self.stacks.items():
            pair = adapter.factors.get(key)
            if self.device == "cpu":
                a_stack, bt_stack = a_stack.numpy(), bt_stack.numpy()
            if pair is None:
                a_stack[first:end], bt_stack[first:end] = 0, 0
                continue
            a, b = pair
            a_stack[first : first + rank] = a
            if isinstance(b, np.ndarray):
                np.multiply(b.T, scaling, out=bt_stack[first : first + rank])
            else:
                torch.mul(b.T, adapter.scaling, out=bt_stack[first : first + rank])
            a_stack[first + rank : end], bt_stack[first + rank : end] = 0, 0

    def _stack_targets(self) -> _StackTable:
        """The stacks as ``lora_pack`` and ``lora_read`` take them (made once: the stacks never move)."""
        if self._targets is None:
            keys = list(self.stacks)
            pairs = list(self.stacks.values())
            self._targets = _StackTable(
                keys, np.array([a.data_ptr() for a, _ in pairs], dtype=np.uint64),
                np.array([bt.data_ptr() for _, bt in pairs], dtype=np.uint64),
                np.array([self.shapes[k][1] for k in keys], dtype=np.int64),
                np.array([self.shapes[k][0] for k in keys], dtype=np.int64))  # fmt: skip
        return self._targets

    def _pack(self, adapter: LoraAdapter) -> bool:
        """:meth:`_write` of factors read already, through ``lora_pack``; False where the kernels
        are not built here."""
        kernels = loaded()
        if kernels is None:
            return False
        table = self._stack_targets()
        sources = [_fp32(adapter.factors.get(key, (None, None))) for key in table.keys]
        a_sources = np.array([a.ctypes.data if a is not None else 0 for a, _ in sources], dtype=np.uint64)
        b_sources = np.array([b.ctypes.data if b is not None else 0 for _, b in sources], dtype=np.uint64)
        status = kernels.lora_pack(len(table.keys), a_sources.ctypes.data, b_sources.ctypes.data, table.a.ctypes.data,
                                   table.bt.ctypes.data, table.ins.ctypes.data, table.outs.ctypes.data,
                                   adapter.slot * self.max_rank, adapter.rank, self.max_rank,
                                   float(np.float32(adapter.scaling)), threads())  # fmt: skip
        if status:
            raise ValueError(f"lora_pack refused rank {adapter.rank} for slots of {self.max_rank} (status {status})")
        return True

    def _read_into_slot(self, adapter: LoraAdapter) -> bool:
        """An fp32 adapter's file read straight into its slot by ``lora_read`` (``lora_add.c``):
        each ``A`` into its rows as it lies, each ``B`` laid out as it is read, so the file's bytes
        are copied once and passed over once more, on as many plain threads as torch steps with
        (not an OpenMP team: :func:`~gyrfalcon.kernels.native.threads`). False where that does not
        apply (another dtype, no kernels): the caller reads the factors first."""
        kernels = loaded()
        if kernels is None or any(entry.dtype != "F32" for pair in adapter.layout.values() for entry in pair):
            return False
        table = self._stack_targets()
        pairs = [adapter.layout.get(key) for key in table.keys]
        a_at = np.array([-1 if pair is None else pair[0].begin for pair in pairs], dtype=np.int64)
        b_at = np.array([-1 if pair is None else pair[1].begin for pair in pairs], dtype=np.int64)
        try:
            fd = os.open(Path(adapter.path) / "adapter_model.safetensors", os.O_RDONLY)
        except OSError as exc:
            raise unreadable(exc.strerror) from None
        try:
            check_identity(fd, adapter.file_id)
            status = kernels.lora_read(fd, len(pairs), a_at.ctypes.data, b_at.ctypes.data, table.a.ctypes.data,
                                       table.bt.ctypes.data, table.ins.ctypes.data, table.outs.ctypes.data,
                                       adapter.slot * self.max_rank, adapter.rank, self.max_rank,
                                       float(np.float32(adapter.scaling)), torch.get_num_threads())  # fmt: skip
            if status == 0:  # (written again while it was read: its modification time says so)
                check_identity(fd, adapter.file_id)
        finally:
            os.close(fd)
        if status == -errno.ENOMEM:
            raise MemoryError("lora_read could not allocate a buffer")
        if status == -errno.EINVAL:
            raise ValueError(f"lora_read refused rank {adapter.rank} for slots of {self.max_rank}")
        if status < 0:
            raise unreadable(os.strerror(-status))
        if status > 0:  # (its size was checked with its header: written again meanwhile)
            raise changed()
        return True

    def _check_name(self, name: str, replace: bool) -> None:
        if name in self._known and not replace:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                               "place, set 'load_inplace' to True.", "lora_name")  # fmt: skip

    def unload(self, name: str) -> None:
        """Forget ``name``: its slot is given up once no request holds it."""
        with self._lock:
            if self._known.pop(name, None) is None:
                raise AdapterError(f"The lora adapter '{name}' cannot be found.", "lora_name", found=False)
            self._adapters.pop(name, None)

    def known(self, name: str) -> bool:
        return name in self._known

    def held(self) -> list[tuple[str, str]]:
        """Every adapter known, ``(name, folder)``, in the order they were loaded."""
        with self._lock:
            return list(self._known.items())
