"""A direct forward of Llama-shaped decoders (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

Why it exists: transformers' modelling code runs about 285 operators per layer and step on the
default model (wrappers, dtype round trips, a rotary embedding per tensor); this forward runs about
40, with q/k/v and gate/up each fused into one matmul
(:func:`~gyrfalcon.kernels.quant.layers.fuse_outputs`: their weights shared; int4's scale
tables are copied, 8.3 MiB on the default model).
Measured on the 2-core CPU, default model, batch 1: 18.5 ms a step through transformers, 16.2 ms here.

It uses the model's own modules — embeddings, rotary embedding (its values computed once, then
looked up: :class:`RotaryTable`), norms' weights, the linear layers in whatever kernel they were
loaded (dense, int4, int8), the head — and the same attention function
(:func:`~gyrfalcon.engine.model.attention.paged_attention`), so it computes what transformers does
in the same kernels; and compiled (the CPU's decode step), it computes the same bits as eager. The runner still checks it against transformers' forward once at load
(:meth:`~gyrfalcon.engine.model.runner.ModelRunner.check_direct`) and serves transformers'
forward where it disagrees; any other architecture always runs transformers' forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gyrfalcon.kernels import native
from gyrfalcon.engine.model.attention import STEP_KWARG, StepMetadata, paged_attention
from gyrfalcon.kernels.quant.layers import fuse_outputs

#: the ``model_type``s whose decoder layers this forward reproduces
DIRECT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def mean_square(h: torch.Tensor) -> torch.Tensor:
    """``mean(h², -1)`` of fp32 ``h``, keeping the dimension: by ``mean_square.c`` where the engine's
    kernels are loaded (:mod:`~gyrfalcon.kernels.native`; one call, each row summed in one fixed
    order), else by ATen's kernels."""
    kernels = native.loaded()
    if kernels is None or h.device.type != "cpu":
        return h.pow(2).mean(-1, keepdim=True)
    h = h.contiguous()
    out = torch.empty((*h.shape[:-1], 1))
    if h.numel() and kernels.mean_square(h.data_ptr(), out.data_ptr(), h.numel() // h.shape[-1], h.shape[-1],
                                         native.threads()):  # fmt: skip
        raise MemoryError("mean_square could not allocate a row's buffer")
    return out


#: :func:`mean_square` as an operator, for a compiled step where the kernels are not loaded (ATen's order)
_mean_square = native.operator("mean_square(Tensor h) -> Tensor", mean_square,
                               lambda h: h.new_empty((*h.shape[:-1], 1)))

#: the lanes ``mean_square.c`` sums a row in
LANES = 16


def _mean_square_in_lanes(h: torch.Tensor) -> torch.Tensor:
    """:func:`mean_square` with ``mean_square.c``'s sums as elementwise operations, which a compiled
    step fuses into the norm and which round as the kernel does (see its comment: the squares,
    the 16-lane chunks summed pairwise, then the lanes, then the division). An opaque operator's
    call cost about 7 µs, 61 calls a step. (Summed chunk after chunk instead, the unrolled
    additions made the first compile four times as long.)"""
    width = h.shape[-1]
    chunks = 1
    while chunks * LANES < width:
        chunks *= 2
    acc = F.pad(h * h, (0, chunks * LANES - width)).unflatten(-1, (chunks, LANES))
    while acc.shape[-2] > 1:
        half = acc.shape[-2] // 2
        acc = acc[..., :half, :] + acc[..., half:, :]
    acc = acc[..., 0, :]
    half = LANES // 2
    while half:
        acc = acc[..., :half] + acc[..., half : 2 * half]
        half //= 2
    return acc / width


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """Transformers' Llama RMSNorm, operation for operation but the mean of squares (:func:`mean_square`).

    A compiled step must sum the squares as the eager step does: inductor's own reduction sums in
    another order, and a compiled norm differed from the eager one in the last bit for about a
    quarter of the rows. It sums them in ``mean_square.c``'s order (:func:`_mean_square_in_lanes`),
    or — without the kernels — calls the eager function as an opaque operator."""
    h = x.float()
    if not torch.compiler.is_compiling():
        square = mean_square(h)
    else:
        square = _mean_square_in_lanes(h) if native.loaded() is not None and h.device.type == "cpu" else _mean_square(h)
    h = h * torch.rsqrt(square + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[T, heads, D]`` (cos/sin ``[T, 1, D]``), as transformers' ``rotate_half``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def fused_parts(layer: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
    """A decoder layer's projections that the direct forward computes in one product each, by the
    fused layer's name (:class:`_Layer`'s ``qkv`` and ``gate_up``), in the order of its outputs."""
    attn, mlp = layer.self_attn, layer.mlp
    return {"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], "gate_up": [mlp.gate_proj, mlp.up_proj]}


class _Layer:
    """One decoder layer's modules, its fused projections and its attention's sliding window."""

    def __init__(self, layer: torch.nn.Module, config) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attn, self.mlp = attn, mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        #: the projections each fused layer joins
        self.parts = fused_parts(layer)
        self.qkv, self.gate_up = fuse_outputs(self.parts["qkv"]), fuse_outputs(self.parts["gate_up"])
        self.widths = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        window = getattr(attn, "sliding_window", None)
        if window is None and config.model_type == "mistral":
            window = getattr(config, "sliding_window", None)  # Mistral passes it at each call
        self.window = window

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.qkv is not None:
            return self.qkv(x).split(self.widths, dim=-1)
        return self.attn.q_proj(x), self.attn.k_proj(x), self.attn.v_proj(x)

    def mlp_forward(self, x: torch.Tensor, lora: Any = None, index: int = 0) -> torch.Tensor:
        """The MLP of rows ``x``; ``lora``: the step's adapter rows (:class:`~gyrfalcon.engine.lora.step.LoraRows`)
        whose products join this layer's (``index``) projections."""
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.mlp.gate_proj(x), self.mlp.up_proj(x)
        if lora is not None:
            lora.add(gate, x, index, "gate_proj")
            lora.add(up, x, index, "up_proj")
        inner = F.silu(gate) * up
        out = self.mlp.down_proj(inner)
        if lora is not None:
            lora.add(out, inner, index, "down_proj")
        return out


def unsupported(model) -> str | None:
    """Why :class:`DirectDecoder` cannot run ``model`` (None: it can)."""
    config = model.config
    if config.model_type not in DIRECT_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {', '.join(DIRECT_MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the direct forward does silu)"
    if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1"
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"the model has no model.{name}"
    return None


#: the largest cos/sin table :class:`RotaryTable` keeps (128k positions of a 128-wide head in fp32 take
#: 128 MiB; beyond it the model's rotary module runs each step, and a compiled CPU step does not serve)
ROTARY_TABLE_LIMIT = 256 * 2**20


class RotaryTable:
    """The cos and sin of every position below ``max_positions``, computed once by the model's own
    rotary embedding and looked up by position each step.

    Why: inductor computes ``cos``/``sin`` other than ATen does (a last bit apart from position 1
    on), so a compiled step that computed them differed from the eager step in every row past
    position 0; looked up, they are the same bits in both (and a step runs two trig kernels fewer).
    A rotary embedding whose frequencies depend on the batch (``dynamic``, ``longrope``) runs as
    it is, as does a table over :data:`ROTARY_TABLE_LIMIT`."""

    def __init__(self, rotary: torch.nn.Module, max_positions: int, dtype: torch.dtype, device) -> None:
        self.rotary = rotary
        self.cos = self.sin = None
        rope_type = getattr(rotary, "rope_type", "default")
        head_dim = rotary.inv_freq.shape[-1] * 2
        if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope":
            return
        if 2 * max_positions * head_dim * torch.finfo(dtype).bits // 8 > ROTARY_TABLE_LIMIT:
            return
        with torch.inference_mode():
            positions = torch.arange(max_positions, device=device).unsqueeze(0)
            cos, sin = rotary(torch.empty(0, dtype=dtype, device=device), position_ids=positions)
        self.cos, self.sin = cos[0], sin[0]

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, D]`` cos and sin of ``positions`` ``[1, T]`` (``hidden``: the step's embeddings)."""
        if self.cos is None:
            cos, sin = self.rotary(hidden, position_ids=positions)
            return cos[0].unsqueeze(1), sin[0].unsqueeze(1)
        flat = positions[0]
        return self.cos.index_select(0, flat).unsqueeze(1), self.sin.index_select(0, flat).unsqueeze(1)


class DirectDecoder:
    """``decoder(input_ids [1, T], positions [1, T], step, keep)`` → logits ``[K, V]`` of the kept
    rows, like the runner's transformers call (see the module docstring); positions stay below
    ``max_positions``."""

    def __init__(self, model, max_positions: int, kernels: Path | None = None) -> None:
        self.model = model
        #: what sums the norms' squares (the start-up line); ``kernels``: the folder the engine's C
        #: kernels are built in (:func:`~gyrfalcon.kernels.native.library`)
        self.norms = "ATen"
        if model.device.type == "cpu":
            try:
                native.library(kernels)
                self.norms = "mean_square.c"
            except native.KernelUnavailable as error:
                self.norms = f"ATen ({error})"
        inner = model.model
        self.embed, self.norm = model.get_input_embeddings(), inner.norm
        self.rotary = RotaryTable(inner.rotary_emb, max_positions, model.dtype, model.device)
        self.head = model.get_output_embeddings()
        self.layers = [_Layer(layer, model.config) for layer in inner.layers[: model.config.num_hidden_layers]]
        #: runs a step of decode rows only, every layer in one call (the runner sets it once it has
        #: proved it gives these operators' bits: :mod:`~gyrfalcon.engine.model.layer_loop`)
        self.layer_loop = None

    @property
    def fused(self) -> bool:
        """Whether every layer's projections run fused."""
        return all(layer.qkv is not None and layer.gate_up is not None for layer in self.layers)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepMetadata, keep) -> torch.Tensor:
        hidden = self.embed(input_ids)
        x = hidden[0]
        tokens = x.shape[0]
        if (self.layer_loop is not None and _decode_rows_only(step, tokens)
                and not torch.compiler.is_compiling()):  # fmt: skip
            x = self.layer_loop(x, positions[0], step)
        else:
            x = self._layers(x, positions, step)
        if isinstance(keep, int):  # transformers' logits_to_keep: the last ``keep`` rows (0: all)
            x = x[-keep:] if keep else x
        else:
            x = x[keep]
        return self.head(_rms_norm(x, self.norm))

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, step: StepMetadata) -> torch.Tensor:
        """``x`` ``[T, hidden]`` through every layer, operator by operator."""
        cos, sin = self.rotary(x, positions)  # [T, 1, D]
        tokens = x.shape[0]
        lora = step.lora
        for index, layer in enumerate(self.layers):
            attn = layer.attn
            h = _rms_norm(x, layer.input_norm)
            q, k, v = layer.projections(h)
            if lora is not None:
                for part, name in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")):
                    lora.add(part, h, index, name)
            q, k, v = q.view(tokens, -1, attn.head_dim), k.view(tokens, -1, attn.head_dim), v.view(tokens, -1, attn.head_dim)
            if layer.q_norm is not None:
                q, k = _rms_norm(q, layer.q_norm), _rms_norm(k, layer.k_norm)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            out, _ = paged_attention(attn, q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                     v.transpose(0, 1).unsqueeze(0), None, scaling=attn.scaling,
                                     sliding_window=layer.window, **{STEP_KWARG: step})  # fmt: skip
            out = out.reshape(tokens, -1)
            o = attn.o_proj(out)
            if lora is not None:
                lora.add(o, out, index, "o_proj")
            x = x + o
            x = x + layer.mlp_forward(_rms_norm(x, layer.post_norm), lora, index)
        return x


def _decode_rows_only(step: StepMetadata, tokens: int) -> bool:
    """Whether every row of the step is a decode row, in order (its decode group is the whole step)."""
    return step.attention == "gather" and not step.prefills and (
        step.decode_only or (step.decode_rows is not None and step.decode_rows.shape[0] == tokens))
