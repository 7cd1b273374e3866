"""Tensor-parallel Phi-3 / Phi-4-mini (``Phi3ForCausalLM``).

The modules are Llama's (:mod:`tpguide.model.llama`); what differs:

* the checkpoint stores ``self_attn.qkv_proj`` (rows ``[q | k | v]``) and
  ``mlp.gate_up_proj`` (rows ``[gate | up]``) fused; the loader hands each
  part to the packed layers' weight loaders as a row view
  (:func:`fused_parts`), so each rank still reads only its own rows;
* RoPE as configured: ``longrope`` (short/long factors) and
  ``partial_rotary_factor`` (Phi-4-mini rotates 3/4 of each head), both in
  :class:`~tpguide.model.rotary.RotaryEmbedding`;
* a ``sliding_window`` in the config applies to every layer.
"""

from __future__ import annotations

from typing import List, Tuple

from tpguide.model.config import ModelConfig
from tpguide.model.llama import LlamaForCausalLM

#: Fused checkpoint tensor -> packed parameter; the parts' shard ids in row order.
FUSED_MODULES = {".self_attn.qkv_proj.": ("q", "k", "v"), ".mlp.gate_up_proj.": (0, 1)}


def fused_parts(name: str, config: ModelConfig) -> List[Tuple[object, int, int]]:
    """``(shard_id, first_row, num_rows)`` of each part of fused tensor ``name``; ``[]`` if not fused."""
    d = config.head_dim
    for key, shard_ids in FUSED_MODULES.items():
        if key in name:
            if shard_ids == (0, 1):
                sizes = [config.intermediate_size] * 2
            else:
                sizes = [config.num_attention_heads * d, config.num_key_value_heads * d,
                         config.num_key_value_heads * d]
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            return list(zip(shard_ids, starts, sizes))
    return []


class Phi3ForCausalLM(LlamaForCausalLM):
    """One rank's shard of a Phi-3 causal LM (Llama modules; fused checkpoint tensors)."""
