"""A decode step's decoder layers in one call of ``decode_layers.c`` (:mod:`~gyrfalcon.kernels.native`).

Why: on a CPU a decode step of the default model spends more time calling its ~1,200 operators
than computing them at small batches (eager, batch 1: about 14 ms a step, of which the kernels
about 10). The compiled step (:mod:`~gyrfalcon.engine.model.compiled`) fused them, but took 5 to
7 minutes of compiling on a fresh 2-core machine and kept a few hundred MiB of compiler state in
the engine. The loop of ``decode_layers.c`` calls the same kernels as the eager step and does the
elementwise work between them as ATen does, so it gives the eager step's bits, with nothing to
compile: :meth:`~gyrfalcon.engine.model.runner.ModelRunner.check_layer_loop` proves it at start-up before it serves
(``DirectDecoder`` then runs every step made only of decode rows through it, and mixed steps
through the operators, to the same bits).

It takes the direct forward's Llama-shaped layers whose four products are all int4 layers of one
input format (:class:`~gyrfalcon.kernels.quant.q4.Q4Linear`: the GGUF's bits, the CPU's
default), an fp32 stream, a cos/sin table, a cache of fp32, bf16 or fp16 read in place
(``one_query_attention.c``); :func:`unsupported` says why not otherwise, and the operators serve.
"""

from __future__ import annotations

import torch

from gyrfalcon.engine.model.one_query import CACHE_FORMATS
from gyrfalcon.kernels import native
from gyrfalcon.kernels.quant.q4 import INPUT_CODES, SOURCES, Q4Linear

def unsupported(decoder, cache, rows_in_place: bool) -> str | None:
    """Why :class:`LayerLoop` cannot run ``decoder``'s layers over ``cache`` (None: it can)."""
    if native.loaded() is None:
        return "the engine's kernels are not loaded"
    if not rows_in_place:
        return "decode rows do not read the KV blocks in place"
    if decoder.model.dtype != torch.float32 or decoder.rotary.cos is None:
        return "an fp32 stream and a cos/sin table are needed"
    inputs = set()
    for layer in decoder.layers:
        products = (layer.qkv, layer.attn.o_proj, layer.gate_up, layer.mlp.down_proj)
        if not all(isinstance(p, Q4Linear) for p in products):
            return "every layer's products must be fused int4 layers (Q4Linear)"
        if layer.q_norm is not None:
            return "q/k norms"
        inputs |= {p.inputs for p in products}
        for norm in (layer.input_norm, layer.post_norm):
            if norm.weight.dtype != torch.float32 or norm.variance_epsilon != decoder.norm.variance_epsilon:
                return "norms of another dtype or epsilon"
    if len(inputs) != 1:
        return "int4 layers of several input formats"
    return None


class LayerLoop:
    """``loop(x [B, hidden], positions [B], step)`` → ``x`` after every layer, for a step of decode
    rows only (``step``'s decode group); ``x`` is updated in place."""

    def __init__(self, decoder) -> None:
        first = decoder.layers[0]
        self.decoder = decoder
        self.heads = first.widths[0] // first.attn.head_dim
        self.kv_heads = first.widths[1] // first.attn.head_dim
        self.dim = first.attn.head_dim
        self.intermediate = first.mlp.down_proj.in_features
        self.eps = float(decoder.norm.variance_epsilon)
        self.scale = float(first.attn.scaling if first.attn.scaling is not None else self.dim**-0.5)
        self.inputs = first.qkv.inputs
        self.inputs_code = INPUT_CODES[self.inputs]
        self._table: tuple[object, torch.Tensor] | None = None
        self._adapters: tuple[tuple[int, int], torch.Tensor] | None = None

    def _layers(self, cache) -> torch.Tensor:
        """The ``[layers, 17]`` table over ``cache`` (made once per cache), in the order of
        ``decode_layers.c``'s field enum: nibbles, scales and bias (0: none) of q/k/v, o_proj,
        gate/up and down_proj; the two norms' weights; the layer's keys and values; its window."""
        if self._table is not None and self._table[0] is cache:
            return self._table[1]
        rows = []
        for index, layer in enumerate(self.decoder.layers):
            row = []
            for product in (layer.qkv, layer.attn.o_proj, layer.gate_up, layer.mlp.down_proj):
                row += [product.nibbles.data_ptr(), product.scales.data_ptr(),
                        0 if product.bias is None else product.bias.data_ptr()]  # fmt: skip
            row += [layer.input_norm.weight.data_ptr(), layer.post_norm.weight.data_ptr(),
                    cache.keys[index].data_ptr(), cache.values[index].data_ptr(), int(layer.window or 0)]  # fmt: skip
            rows.append(row)
        table = torch.tensor(rows, dtype=torch.long)
        self._table = (cache, table)
        return table

    def _lora_table(self, lora) -> torch.Tensor:
        """``lora``'s (:class:`~gyrfalcon.engine.lora.step.LoraRows`) stacks for ``decode_layers.c``,
        made again only when the registry's projections with an adapter change (they only grow)."""
        key = (id(lora.stacks), len(lora.active))
        if self._adapters is None or self._adapters[0] != key:
            self._adapters = (key, lora.table(len(self.decoder.layers)))
        return self._adapters[1]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        cache = step.cache
        table = self._layers(cache)
        blocks = step.decode_blocks.contiguous()
        positions = positions.contiguous()
        slots = step.slot_mapping.contiguous()
        x = x.contiguous()
        rows = x.shape[0]
        lora = step.lora
        lora_table = self._lora_table(lora) if lora is not None else None
        if rows:
            status = native.loaded().decode_layers(
                table.data_ptr(), table.shape[0], x.data_ptr(), rows, x.shape[1], self.heads, self.kv_heads, self.dim,
                self.intermediate, positions.data_ptr(), slots.data_ptr(), blocks.data_ptr(), blocks.shape[1],
                cache.block_size, self.decoder.rotary.cos.data_ptr(), self.decoder.rotary.sin.data_ptr(), self.eps,
                self.scale, CACHE_FORMATS[cache.keys[0].dtype], self.inputs_code,
                None if lora is None else lora_table.data_ptr(), None if lora is None else lora.slots.data_ptr(),
                0 if lora is None else lora.rank, 0 if lora is None else lora.width, native.threads())
            if status:
                raise MemoryError(f"decode_layers failed ({status}: -1 a buffer, -2 or -3 a shape a kernel does "
                                  "not take)")
        return x

    def describe(self) -> str:
        """For the start-up line."""
        layers = len(self.decoder.layers)
        return f"decode_layers.c: a decode step's {layers} layers in one call ({SOURCES[self.inputs]})"
