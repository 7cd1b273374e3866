"""Rotary position embedding (Su et al. 2021, "RoFormer"), rotate-half layout as in HF Llama.

Covers what the supported families configure: scaled inverse frequencies
(linear, llama3, yarn through transformers' init functions), partial rotary
(Phi-3's ``partial_rotary_factor``: only the first ``rotary_dim`` elements of
each head rotate), per-layer-type bases (Gemma 3's local and global layers)
and ``longrope`` (Phi-3).

longrope has two sets of factors.  transformers picks per forward call: long
when the sequence is longer than ``original_max_position_embeddings``, and
when a generation crosses that length it recomputes the whole cache with the
long factors.  Choosing per step instead (vLLM: long for the whole batch if
any position is past the original context) would mix the two sets inside one
prompt under chunked prefill, and make a sequence's result depend on its
batch.  So here the choice is made once per KV cache: long factors for every
token when ``max_model_len > original_max_position_embeddings``, short ones
otherwise (:meth:`RotaryEmbedding.set_max_model_len`).  Equal to transformers for every
sequence when ``max_model_len`` is within the original context, and for
prompts longer than it otherwise; a shorter sequence in a long-context cache
uses the long factors where transformers would use the short ones.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from tpguide.kernels.fixed_order_cpu import unary_fixed_order
from tpguide.kernels.triton_path import use_triton
from tpguide.model.config import ModelConfig


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[..., D] -> [..., D]``: ``(x1, x2) -> (-x2, x1)`` on the two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on the first ``R`` elements of each head, the rest unchanged; a new tensor.

    ``x [T, H, D]``; ``cos``, ``sin`` ``[T, 1, R]`` of ``x``'s dtype (``R <= D``,
    even); each product and the sum rounded to ``x``'s dtype (torch ops).
    """
    r = cos.size(-1)
    if r == x.size(-1):
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


class RotaryEmbedding(nn.Module):
    """RoPE of one layer type; one instance is shared by every layer of that type.

    Parameters
    ----------
    config : ModelConfig
    layer_type : str
        ``"full_attention"`` or ``"sliding_attention"`` (selects Gemma 3's base).
    """

    def __init__(self, config: ModelConfig, layer_type: str = "full_attention") -> None:
        super().__init__()
        params = config.rope_params(layer_type)
        inv_freq, self.attention_scaling = config.rope_inv_freq(layer_type=layer_type)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [Dr/2] fp32
        self.rotary_dim = 2 * inv_freq.numel()
        self.longrope_threshold: Optional[int] = None
        if params.get("rope_type") == "longrope":
            self.longrope_threshold = int(params["original_max_position_embeddings"])
            long_inv_freq, _ = config.rope_inv_freq(layer_type=layer_type, seq_len=self.longrope_threshold + 1)
            self.register_buffer("short_inv_freq", inv_freq.clone(), persistent=False)
            self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)
        self._cached_positions: Optional[torch.Tensor] = None  # the step's positions tensor
        self._cached_cos_sin: Optional[Dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]]] = None  # by dtype

    def set_max_model_len(self, max_model_len: int) -> None:
        """longrope: long factors iff ``max_model_len > original_max_position_embeddings`` (tokens); else a no-op."""
        if self.longrope_threshold is not None:
            use_long = max_model_len > self.longrope_threshold
            self.inv_freq = self.long_inv_freq if use_long else self.short_inv_freq
            self._cached_positions = self._cached_cos_sin = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[T, 1, Dr]`` of ``dtype`` for int64 ``positions [T]`` (times the attention scaling).

        Computed in fp32 once per step and cast once per dtype: the layers of
        one forward pass share the same ``positions`` object.
        """
        if positions is not self._cached_positions or self._cached_cos_sin is None:
            freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, Dr/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [T, Dr]
            if emb.is_cuda:
                cos, sin = emb.cos(), emb.sin()
            else:  # scalar libm per element: a position's table row does not depend on the batch
                cos, sin = unary_fixed_order(emb, "cos"), unary_fixed_order(emb, "sin")
            self._cached_cos_sin = {torch.float32: ((cos * self.attention_scaling)[:, None, :],  # [T, 1, Dr]
                                                    (sin * self.attention_scaling)[:, None, :])}
            self._cached_positions = positions
        cached = self._cached_cos_sin.get(dtype)
        if cached is None:
            cos, sin = self._cached_cos_sin[torch.float32]
            cached = self._cached_cos_sin[dtype] = (cos.to(dtype), sin.to(dtype))
        return cached

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, H, D]`` and ``k [T, Hkv, D]`` by ``positions`` int64 ``[T]``; new tensors.

        The CUDA code path rotates both in one launch with the same bits
        (:func:`~tpguide.kernels.rotary_triton.rotary_triton`); the
        fixed-order CPU path does the same in one kernel with the cache write
        (:func:`~tpguide.kernels.fused_cpu.rotary_fixed_order`, called by
        :meth:`~tpguide.model.attention.Attention.forward_rotary`).
        """
        cos, sin = self.cos_sin(positions, q.dtype)
        if use_triton(q):
            from tpguide.kernels.rotary_triton import rotary_triton

            return rotary_triton(q, k, cos, sin)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
