"""Tensor-parallel Qwen3 (``Qwen3ForCausalLM``): Llama with per-head q/k RMS norms and no qkv bias.

Per layer, the only difference from :mod:`tpguide.model.llama`::

    qkv_proj ─ q_norm(each q head), k_norm(each k head) ─ RoPE ─ attention

``q_norm`` / ``k_norm`` weights are ``[head_dim]``, shared by all heads, so
every rank holds them whole; zero-padded heads stay zero through the norm.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tpguide.dist import TPGroup
from tpguide.model.config import ModelConfig
from tpguide.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class QKNormAttention(LlamaAttention):
    """Attention with per-head RMS norms of q and k before RoPE (norm type from the layer's ``norm_cls``)."""

    def __init__(self, config: ModelConfig, group: TPGroup, dtype: torch.dtype, layer_idx: int = 0,
                 norm_cls: Optional[type] = None) -> None:
        super().__init__(config, group, dtype, layer_idx)
        norm_cls = norm_cls or LlamaDecoderLayer.norm_cls
        self.q_norm: nn.Module = norm_cls(config.head_dim, config.rms_norm_eps, dtype)
        self.k_norm: nn.Module = norm_cls(config.head_dim, config.rms_norm_eps, dtype)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, Hl, D]``, ``k [T, Kl, D]`` normed over ``D``."""
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = QKNormAttention


class Qwen3Model(LlamaModel):
    decoder_layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    """One rank's shard of a Qwen3 causal LM (see :class:`~tpguide.model.llama.LlamaForCausalLM`)."""

    model_cls = Qwen3Model
