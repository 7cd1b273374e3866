"""Which decoder stacks run as one C call on CPU, and their descriptions (docs/architecture.md §6, "The decoder stack in one call").

:class:`DecoderStackCPU` takes a :class:`~tpguide.model.llama.LlamaModel`
whose every layer is the plain Llama block on the fixed-order CPU path at tp 1
(Llama, SmolLM2, Mistral-shape checkpoints) and runs its layers through
:func:`~tpguide.kernels.decoder_layers_cpu.run_decoder_layers`: the kernels
the per-op path calls, with the same inputs, in one trip into C per forward.
Anything else (another block, biases, q/k norms, tp > 1 where the partials
are gathered between kernels, AMX tiles, a CUDA tensor) keeps the per-op
path; so does a step whose kernels refuse their arguments, so that the
per-op path raises its error naming the value.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from tpguide.kernels.decoder_layers_cpu import LayerDesc, linear_desc, run_decoder_layers
from tpguide.kernels.fixed_order_cpu import UNARY_OPS, PackedWeight
from tpguide.kernels.fused_cpu import takes
from tpguide.kernels.triton_path import use_triton
from tpguide.model.attention import AttentionMetadata
from tpguide.model.held_weights import is_released
from tpguide.model.invariant_reduce import packed_weight
from tpguide.model.norm import RMSNorm


def _plain_layer(layer, plain: Tuple[type, type, type]) -> bool:
    """The plain Llama block on the fixed-order path, with nothing the stack call does not run.

    ``plain``: the classes ``(LlamaDecoderLayer, LlamaAttention, LlamaMLP)`` exactly (no subclass).
    """
    attn, mlp = layer.self_attn, layer.mlp
    if (type(layer), type(attn), type(mlp)) != plain:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n) is not RMSNorm or not n.fixed_order for n in norms):
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(lin.bias is not None or lin.group.tp_size != 1 for lin in linears):
        return False
    if not (attn.qkv_proj.fixed_order and mlp.gate_up_proj.fixed_order):
        return False
    for row in (attn.o_proj, mlp.down_proj):  # fixed units added in order on this rank, nothing gathered
        if row.reduction_unit is None or row.num_real_units != row.num_local_units:
            return False
    return attn.attn.fixed_order and mlp.fixed_order and mlp.act_name in ("silu", "gelu_tanh")


class DecoderStackCPU:
    """The decoder layers of a qualifying model as one C call (module docstring).

    Parameters
    ----------
    layers : list of LlamaDecoderLayer
        Every layer of the model, each :func:`_plain_layer`.
    """

    def __init__(self, layers: List) -> None:
        self.layers = layers
        attn = layers[0].self_attn
        self.heads, self.kv_heads = attn.qkv_proj.num_heads, attn.qkv_proj.num_kv_heads
        self.head_dim = attn.qkv_proj.head_dim
        self.intermediate = layers[0].mlp.gate_up_proj.output_size_per_partition // 2
        self.descs = (LayerDesc * len(layers))()
        self._weights_fixed = False
        self._attns = [layer.self_attn.attn for layer in layers]
        self._caches: list = []  # the (k, v) cache tensors the descriptions point at
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
        return cls(layers)

    def _packed(self) -> List[Tuple[PackedWeight, ...]]:
        out = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out.append((packed_weight(attn.qkv_proj, attn.qkv_proj.weight),
                        packed_weight(attn.o_proj, attn.o_proj.weight, attn.o_proj.num_local_units),
                        packed_weight(mlp.gate_up_proj, mlp.gate_up_proj.weight),
                        packed_weight(mlp.down_proj, mlp.down_proj.weight, mlp.down_proj.num_local_units)))
        return out

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
        self._weights_fixed = all(is_released(m.weight) for layer in self.layers
                                  for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                            layer.mlp.gate_up_proj, layer.mlp.down_proj))
        return widest

    def _describe_caches(self, caches: list, dtype: torch.dtype) -> bool:
        """Point the descriptions at the layers' KV caches; False if one is missing or of another dtype."""
        self._caches = []
        for desc, (kc, vc) in zip(self.descs, caches):
            if kc is None or vc is None or kc.dtype != dtype or vc.dtype != dtype or kc.shape != vc.shape \
                    or not (kc.is_contiguous() and vc.is_contiguous()) or kc.size(1) != caches[0][0].size(1):
                return False
            desc.k_cache, desc.v_cache, desc.num_blocks = kc.data_ptr(), vc.data_ptr(), kc.size(0)
        self._caches = caches
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
        if len(caches) != len(self._caches) or any(k is not k0 or v is not v0 for (k, v), (k0, v0)
                                                   in zip(caches, self._caches)):  # allocated anew
            if not self._describe_caches(caches, dtype):
                return None
        block_size = caches[0][0].size(1)
        for rope, indices in self._ropes:
            cos, sin = rope.cos_sin(positions, dtype)  # [T, 1, R], computed once per step per table
            if not (cos.is_contiguous() and sin.is_contiguous()):
                return None
            cp, sp, r = cos.data_ptr(), sin.data_ptr(), cos.shape[-1]
            for i in indices:
                desc = self.descs[i]
                desc.cos, desc.sin, desc.rotary_dim = cp, sp, r
        tables = meta.block_tables
        if meta.max_seq_len > tables.size(1) * block_size:
            return None
        tables = tables.to(torch.int64).contiguous()
        seq = meta.token_seq_index.to(torch.int64).contiguous()
        pos = meta.token_positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping(block_size).to(torch.int64).contiguous()
        shape = (self.heads, self.kv_heads, self.head_dim, self.intermediate, widest)
        return run_decoder_layers(self.descs, hidden.contiguous(), None, shape, slots, tables, block_size, seq, pos,
                                  int(meta.max_seq_len))
