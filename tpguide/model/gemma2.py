"""Tensor-parallel Gemma 2 (``Gemma2ForCausalLM``).

Differences from :mod:`tpguide.model.llama`, each after transformers'
``modeling_gemma2.py``:

* ``(1 + w)`` RMS norms (:class:`~tpguide.model.norm.GemmaRMSNorm`), and four
  per layer: ``input``, ``post_attention`` (on the attention output, before
  the residual add), ``pre_feedforward``, ``post_feedforward``::

      x = x + post_attention_layernorm(attn(input_layernorm(x)))
      x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))

* the embedding output times ``sqrt(hidden_size)``;
* GeGLU MLP (tanh GELU on the gate);
* softmax scale ``query_pre_attn_scalar ** -0.5`` and attention-logit
  soft-capping (:class:`~tpguide.model.attention.Attention`);
* final-logit soft-capping on each rank's logits shard
  (:class:`~tpguide.model.vocab_parallel_embedding.ParallelLMHead`);
* sliding-window attention on the layers ``layer_types`` marks (alternate
  layers, starting with a sliding one).
"""

from __future__ import annotations

import torch

from tpguide.dist import TPGroup
from tpguide.model.attention import AttentionMetadata
from tpguide.model.config import ModelConfig
from tpguide.model.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from tpguide.model.norm import GemmaRMSNorm
from tpguide.model.vocab_parallel_embedding import ScaledVocabParallelEmbedding


class Gemma2DecoderLayer(LlamaDecoderLayer):
    """Decoder block with norms before and after both the attention and the MLP."""

    norm_cls = GemmaRMSNorm
    carries_residual = False  # its own block structure (module docstring), run through forward

    def __init__(self, config: ModelConfig, group: TPGroup, dtype: torch.dtype, layer_idx: int = 0) -> None:
        super().__init__(config, group, dtype, layer_idx)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2Model(LlamaModel):
    """Scaled embedding, Gemma decoder layers, ``(1 + w)`` final norm."""

    decoder_layer_cls = Gemma2DecoderLayer
    embedding_cls = ScaledVocabParallelEmbedding

    def __init__(self, config: ModelConfig, group: TPGroup, dtype: torch.dtype) -> None:
        super().__init__(config, group, dtype)
        self.embed_tokens.embed_scale = config.embed_scale


class Gemma2ForCausalLM(LlamaForCausalLM):
    """One rank's shard of a Gemma 2 causal LM (see :class:`~tpguide.model.llama.LlamaForCausalLM`)."""

    model_cls = Gemma2Model
