"""Tensor-parallel Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-235B-A22B).

Qwen3's layers (:mod:`tpguide.model.qwen3`: per-head q/k norms) with the
feed-forward block of each layer chosen as transformers does: the
mixture-of-experts block (:mod:`tpguide.model.moe`) on the layers of
``config.moe_layers`` (``(i + 1) % decoder_sparse_step == 0`` and ``i`` not
in ``mlp_only_layers``), a dense MLP of ``intermediate_size`` elsewhere.
Routing: fp32 softmax, top ``num_experts_per_tok``, renormalised iff
``norm_topk_prob``, the weights rounded to the model dtype.  Checkpoint
names: ``mlp.gate.weight``, ``mlp.experts.N.{gate,up,down}_proj.weight``
(:mod:`tpguide.model.moe_checkpoint`).
"""

from __future__ import annotations

from tpguide.model.moe import moe_or_dense_mlp
from tpguide.model.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    make_mlp = moe_or_dense_mlp


class Qwen3MoeModel(Qwen3Model):
    decoder_layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """One rank's shard of a Qwen3-MoE causal LM (see :class:`~tpguide.model.llama.LlamaForCausalLM`)."""

    model_cls = Qwen3MoeModel
