"""Tensor-parallel Mixtral (``MixtralForCausalLM``: Mixtral-8x7B, 8x22B).

Mistral's layers (:mod:`tpguide.model.llama`; a ``sliding_window`` in the
config applies to every layer) with every feed-forward block the
mixture-of-experts block of :mod:`tpguide.model.moe`: experts of
``intermediate_size``, fp32 softmax, top ``num_experts_per_tok``, always
renormalised, the weights kept in fp32.  Checkpoint names:
``block_sparse_moe.gate.weight``, ``block_sparse_moe.experts.N.w1`` (gate),
``w3`` (up), ``w2`` (down) (:mod:`tpguide.model.moe_checkpoint`).
"""

from __future__ import annotations

from tpguide.model.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from tpguide.model.moe import moe_or_dense_mlp


class MixtralDecoderLayer(LlamaDecoderLayer):
    make_mlp = moe_or_dense_mlp


class MixtralModel(LlamaModel):
    decoder_layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    """One rank's shard of a Mixtral causal LM (see :class:`~tpguide.model.llama.LlamaForCausalLM`)."""

    model_cls = MixtralModel
