"""Tensor-parallel Gemma 3 text (``Gemma3ForCausalLM``): Gemma 2 plus per-head q/k norms.

From :mod:`tpguide.model.gemma2` (norms, scaled embedding, GeGLU,
``query_pre_attn_scalar``, optional soft-caps), with:

* ``q_norm`` / ``k_norm``: ``(1 + w)`` RMS norms over each head before RoPE;
* the sliding/global pattern of ``layer_types`` (five local layers, then one
  global, in the released models), local layers with their own RoPE
  parameters (``rope_parameters["sliding_attention"]``, base 10 000) and
  global ones with ``rope_parameters["full_attention"]`` (base 1 000 000,
  scaled where the config says); one RoPE table per layer type.

The instruction-tuned 4B/12B/27B checkpoints are ``Gemma3ForConditionalGeneration``
(a vision tower plus this decoder); their language model runs on text:
:func:`text_weight_name` maps its tensor names and skips the vision ones.
"""

from __future__ import annotations

from typing import Optional

import torch

from tpguide.dist import TPGroup
from tpguide.model.config import ModelConfig
from tpguide.model.gemma2 import Gemma2DecoderLayer, Gemma2Model
from tpguide.model.llama import LlamaForCausalLM
from tpguide.model.norm import GemmaRMSNorm
from tpguide.model.qwen3 import QKNormAttention


class Gemma3Attention(QKNormAttention):
    """Attention with ``(1 + w)`` per-head q/k norms."""

    def __init__(self, config: ModelConfig, group: TPGroup, dtype: torch.dtype, layer_idx: int = 0) -> None:
        super().__init__(config, group, dtype, layer_idx, norm_cls=GemmaRMSNorm)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3Model(Gemma2Model):
    decoder_layer_cls = Gemma3DecoderLayer


class Gemma3ForCausalLM(LlamaForCausalLM):
    """One rank's shard of a Gemma 3 text causal LM."""

    model_cls = Gemma3Model


#: Checkpoint prefixes of the multimodal model: language-model renames, then tensors the text decoder skips.
TEXT_RENAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                ("model.language_model.", "model."))
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_weight_name(name: str) -> Optional[str]:
    """A ``Gemma3ForConditionalGeneration`` tensor name as the text decoder's, or None for a vision tensor."""
    if name.startswith(VISION_PREFIXES):
        return None
    for old, new in TEXT_RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name
