"""Which decoder stacks run as one C call on CPU, and their descriptions (docs/architecture.md §6, "The decoder stack in one call").

:class:`DecoderStackCPU` takes a :class:`~tpguide.model.llama.LlamaModel`
whose every layer is the plain Llama block on the fixed-order CPU path
(Llama, SmolLM2, Mistral, Phi-3 checkpoints) and runs its layers in C: at tp 1
all of them in one call (:func:`~tpguide.kernels.decoder_layers_cpu.run_decoder_layers`),
at tp > 1 one call per half layer
(:func:`~tpguide.kernels.decoder_layers_cpu.run_decoder_half`) with the
row-parallel unit partials added in order across ranks between them
(:func:`~tpguide.model.invariant_reduce.sum_units`), as the per-op path adds them.  Either way the kernels the per-op path calls, with
the same inputs, in its order.  Anything else (another block, biases, q/k
norms, AMX tiles, the CUDA path, a prefill whose intermediates pass 64 MiB or,
at tp > 1, a sum's row chunk) keeps the per-op path; so does a step whose kernels refuse their arguments,
so that the per-op path raises its error naming the value.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from tpguide.kernels.decoder_layers_cpu import (
    KEPT_WORK_BYTES,
    LayerDesc,
    StepArgs,
    linear_desc,
    run_decoder_half,
    run_decoder_layers,
    work_bytes,
)
from tpguide.kernels.fixed_order_cpu import DTYPE_CODES, UNARY_OPS, PackedWeight
from tpguide.kernels.fused_cpu import takes
from tpguide.kernels.triton_path import use_triton
from tpguide.model.attention import Attention, AttentionMetadata
from tpguide.model.held_weights import is_released
from tpguide.model.invariant_reduce import packed_weight, sum_units
from tpguide.model.norm import RMSNorm
from tpguide.model.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    kept_partials,
)
from tpguide.model.rotary import RotaryEmbedding


def _linears(layer) -> tuple:
    """The layer's ``(qkv_proj, o_proj, gate_up_proj, down_proj)``, the order of a ``LayerDesc``."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _plain_layer(layer, plain: Tuple[type, type, type]) -> bool:
    """The plain Llama block on the fixed-order path, with nothing the stack call does not run.

    ``plain``: the classes ``(LlamaDecoderLayer, LlamaAttention, LlamaMLP)`` exactly (no subclass).
    """
    attn, mlp = layer.self_attn, layer.mlp
    if (type(layer), type(attn), type(mlp)) != plain:
        return False
    linears = _linears(layer)
    if tuple(type(p) for p in (*linears, attn.attn, attn.rotary_emb)) != (
            QKVParallelLinear, RowParallelLinear, MergedColumnParallelLinear, RowParallelLinear, Attention,
            RotaryEmbedding):
        return False  # exactly these classes: a subclass may compute something else
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n) is not RMSNorm or not n.fixed_order for n in norms):
        return False
    if any(lin.bias is not None for lin in linears):
        return False
    if not (attn.qkv_proj.fixed_order and mlp.gate_up_proj.fixed_order):
        return False
    if attn.o_proj.reduction_unit is None or mlp.down_proj.reduction_unit is None:  # fixed units, added in order
        return False
    return attn.attn.fixed_order and mlp.fixed_order and mlp.act_name in ("silu", "gelu_tanh")


def _shape(layer) -> Optional[tuple]:
    """``(hidden, heads, kv_heads, head_dim, intermediate)`` of this rank's layer, None if its linears disagree."""
    qkv, o, gate_up, down = _linears(layer)
    hidden, heads, kv_heads, d = qkv.input_size, qkv.num_heads, qkv.num_kv_heads, qkv.head_dim
    inter = gate_up.output_size_per_partition // 2
    fits = (qkv.output_size_per_partition == (heads + 2 * kv_heads) * d and o.input_size_per_partition == heads * d
            and o.output_size == hidden and gate_up.input_size == hidden and down.input_size_per_partition == inter
            and down.output_size == hidden)
    return (hidden, heads, kv_heads, d, inter) if fits else None


class DecoderStackCPU:
    """The decoder layers of a qualifying model as one C call (module docstring).

    Parameters
    ----------
    layers : list of LlamaDecoderLayer
        Every layer of the model, each :func:`_plain_layer`, all of one :func:`_shape`.

    Not re-entrant: the descriptions are rewritten by every forward (so is the
    per-op path's RoPE cache), so one model runs one forward at a time.
    """

    def __init__(self, layers: List) -> None:
        self.layers = layers
        attn = layers[0].self_attn
        _, self.heads, self.kv_heads, self.head_dim, self.intermediate = _shape(layers[0])
        self.o_projs = [layer.self_attn.o_proj for layer in layers]
        self.down_projs = [layer.mlp.down_proj for layer in layers]
        self.group = attn.o_proj.group
        # every unit on this rank and none padded: the whole stack in one call; else a call per half
        # layer, the unit partials added in order across ranks between them
        self.one_call = all(r.group.tp_size == 1 and r.num_real_units == r.num_local_units
                            for r in self.o_projs + self.down_projs)
        self.descs = (LayerDesc * len(layers))()
        self._weights_fixed = False
        self._attns = [layer.self_attn.attn for layer in layers]
        self._caches: list = []  # (address, shape) of the (k, v) caches the descriptions point at
        ropes: dict = {}  # layers by RoPE table (one table per layer type)
        for i, layer in enumerate(layers):
            ropes.setdefault(id(layer.self_attn.rotary_emb), (layer.self_attn.rotary_emb, []))[1].append(i)
        self._ropes = list(ropes.values())

    @classmethod
    def of(cls, model, plain: Tuple[type, type, type]) -> Optional["DecoderStackCPU"]:
        """The stack of ``model`` (a ``LlamaModel``), or None if a layer does not qualify (``plain``: :func:`_plain_layer`)."""
        layers = list(model.layers)
        if not layers or not all(_plain_layer(layer, plain) for layer in layers):
            return None
        shapes = {_shape(layer) for layer in layers}
        return cls(layers) if len(shapes) == 1 and None not in shapes else None  # one work layout for all

    def _packed(self) -> List[Tuple[PackedWeight, ...]]:
        """Each layer's four packed weights (:func:`_linears`' order; row-parallel ones in their units)."""
        return [tuple(packed_weight(lin, lin.weight, lin.num_local_units if isinstance(lin, RowParallelLinear) else 1)
                      for lin in _linears(layer)) for layer in self.layers]

    def _describe_weights(self) -> Optional[int]:
        """Fill the descriptions' weights; the widest padded linear input, or None for an AMX layout.

        Released weights (start-up's :func:`~tpguide.model.invariant_reduce.prepack_weights`)
        never change, so they are described once; otherwise on every call, as
        ``packed_weight`` repacks an updated weight.
        """
        if self._weights_fixed:
            return self._widest
        widest = 0
        for desc, layer, packed in zip(self.descs, self.layers, self._packed()):
            if any(p.amx for p in packed):
                return None
            desc.qkv, desc.o, desc.gate_up, desc.down = (linear_desc(p) for p in packed)
            widest = max([widest] + [p.num_units * p.padded_unit_size for p in packed])
            desc.input_norm = layer.input_layernorm.weight.data_ptr()
            desc.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            desc.input_eps, desc.post_eps = layer.input_layernorm.eps, layer.post_attention_layernorm.eps
            attn = layer.self_attn.attn
            desc.scale, desc.window = attn.scale, int(attn.sliding_window or 0)
            desc.softcap = float(attn.logit_softcap or 0.0)
            desc.act_op = UNARY_OPS[layer.mlp.act_name]
        self._widest = widest
        self._weights_fixed = all(is_released(lin.weight) for layer in self.layers for lin in _linears(layer))
        return widest

    def _describe_caches(self, caches: list, dtype: torch.dtype, where: list) -> bool:
        """Point the descriptions at the layers' KV caches; False if one does not fit the layers or ``dtype``."""
        self._caches = []
        kv_shape = (self.kv_heads, self.head_dim)
        for desc, (kc, vc) in zip(self.descs, caches):
            if kc.dtype != dtype or vc.dtype != dtype or kc.shape != vc.shape or tuple(kc.shape[2:]) != kv_shape \
                    or not (kc.is_contiguous() and vc.is_contiguous()) or kc.size(1) != caches[0][0].size(1):
                return False
            desc.k_cache, desc.v_cache, desc.num_blocks = kc.data_ptr(), vc.data_ptr(), kc.size(0)
        self._caches = where
        return True

    def run(self, positions: torch.Tensor, hidden: torch.Tensor,
            meta: AttentionMetadata) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(mlp_out, residual)`` of the last layer for ``hidden [T, hidden]``, or None: run the per-op path.

        None when the step is not one the call takes (the CUDA path, another
        dtype than the weights', a cache not allocated or of another dtype,
        block tables too short) or a kernel refused its arguments.
        """
        layers, dtype = self.layers, hidden.dtype
        if use_triton(hidden) or not takes(hidden) or hidden.dim() != 2 \
                or layers[0].input_layernorm.weight.dtype != dtype:  # the CUDA path (or forced: interpreted tests)
            return None
        widest = self._describe_weights()
        if widest is None:
            return None
        caches = [(a.k_cache, a.v_cache) for a in self._attns]
        if any(k is None or v is None for k, v in caches):
            return None
        # remembered by address and shape, not held: allocate_kv_cache frees the old pool first
        where = [(k.data_ptr(), v.data_ptr(), k.shape, k.dtype) for k, v in caches]
        if where != self._caches and not self._describe_caches(caches, dtype, where):
            return None
        block_size = caches[0][0].size(1)
        for rope, indices in self._ropes:
            cos, sin = rope.cos_sin(positions, dtype)  # [T, 1, R], computed once per step per table
            if not (cos.is_contiguous() and sin.is_contiguous()) or cos.shape[0] != hidden.shape[0]:
                return None
            cp, sp, r = cos.data_ptr(), sin.data_ptr(), cos.shape[-1]
            for i in indices:
                desc = self.descs[i]
                desc.cos, desc.sin, desc.rotary_dim = cp, sp, r
        tables, t = meta.block_tables, hidden.shape[0]
        if meta.max_seq_len > tables.size(1) * block_size or positions.shape != (t,) \
                or meta.token_seq_index.shape != (t,) or meta.token_positions.shape != (t,):
            return None  # the per-op path names what does not fit
        tables = tables.to(torch.int64).contiguous()
        seq = meta.token_seq_index.to(torch.int64).contiguous()
        pos = meta.token_positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping(block_size).to(torch.int64).contiguous()
        shape = (self.heads, self.kv_heads, self.head_dim, self.intermediate, widest)
        nbytes = work_bytes(t, DTYPE_CODES[dtype], hidden.shape[1], *shape)
        if nbytes > KEPT_WORK_BYTES:
            return None  # a long prefill: the per-op path holds one intermediate at a time
        hidden = hidden.contiguous()
        args = StepArgs(hidden, shape, slots, tables, block_size, seq, pos, int(meta.max_seq_len), nbytes)
        if self.one_call:
            return run_decoder_layers(self.descs, args, hidden, None)
        return self._by_halves(args, hidden)

    def _by_halves(self, args: StepArgs, hidden: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """tp > 1 (or padded units): each half layer in C, its unit partials summed across ranks in Python.

        The collectives are the per-op path's (one ordered sum across ranks per
        row-parallel layer, :func:`~tpguide.model.invariant_reduce.sum_units`), in
        its order; a step longer than a sum's row chunk
        (``RowParallelLinear.partials_chunk_rows``) keeps the per-op path, and so
        does one a kernel refuses (every rank refuses the same step: the checks
        read the plan, which every rank shares, so all ranks leave together).
        """
        t = hidden.shape[0]
        if any(r.partials_chunk_rows(t) < t for r in (self.o_projs[0], self.down_projs[0])):
            return None
        x, residual = hidden, torch.empty_like(hidden)
        for i, (o_proj, down_proj) in enumerate(zip(self.o_projs, self.down_projs)):
            partials = kept_partials(o_proj.num_local_units, t, o_proj.output_size)  # used until its sum returns
            if not run_decoder_half(self.descs[i], args, 0, x, residual, i == 0, partials):
                return None
            o = sum_units(partials, o_proj.num_real_units, self.group, hidden.dtype)  # the one communication point
            partials = kept_partials(down_proj.num_local_units, t, down_proj.output_size)
            if not run_decoder_half(self.descs[i], args, 1, o, residual, False, partials):
                return None
            x = sum_units(partials, down_proj.num_real_units, self.group, hidden.dtype)
        return x, residual
