"""Tensor-parallel Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2; the base of Qwen3 and Phi-3).

Per layer, Megatron-style, two ``all_reduce`` calls (in the row-parallel
``o_proj`` and ``down_proj``)::

    x ─ RMSNorm ─ qkv_proj (column, local heads) ─ RoPE ─ Attention ─ o_proj (row, all_reduce) ─ + ─
    ─ RMSNorm ─ gate_up_proj (column) ─ SiLU(gate) * up ─ down_proj (row, all_reduce) ─ + ─

Module names follow the Hugging Face checkpoint (``model.layers.N.self_attn``,
``mlp``, ``model.norm``, ``lm_head``) except the packed ``qkv_proj`` and
``gate_up_proj`` (see :mod:`tpguide.model.loader` for the mapping).

The other families subclass these modules and swap parts through class
attributes (``LlamaModel.decoder_layer_cls``, ``LlamaForCausalLM.model_cls``,
``LlamaDecoderLayer.attention_cls``, ``norm_cls``) and the
:meth:`LlamaAttention.qk_norm` hook; see :mod:`tpguide.model.qwen3`,
:mod:`tpguide.model.phi3`, :mod:`tpguide.model.gemma2`, :mod:`tpguide.model.gemma3`.
Sliding-window layers come from ``config.layer_types``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tpguide.dist import TPGroup
from tpguide.kernels.fixed_order_cpu import unary_fixed_order
from tpguide.kernels.fused_cpu import act_and_mul, takes
from tpguide.kernels.triton_path import use_triton
from tpguide.model.attention import Attention, AttentionMetadata
from tpguide.model.config import ModelConfig
from tpguide.model.decoder_stack_cpu import DecoderStackCPU
from tpguide.model.invariant_reduce import reduction_block_size
from tpguide.model.norm import RMSNorm
from tpguide.model.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tpguide.model.rotary import RotaryEmbedding
from tpguide.model.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from tpguide.model.vocab_shard import VocabShard
from tpguide.model.zeroed_pool import check_pool_fits_memory, zeroed_pool

__all__ = ["LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP", "LlamaModel", "RMSNorm",
           "RotaryEmbedding"]


class LlamaAttention(nn.Module):
    """Self-attention of this rank's (padded) heads.

    Parameters
    ----------
    config : ModelConfig
    group : TPGroup
    dtype : torch.dtype
    layer_idx : int
        Selects the layer type (full or sliding window) from ``config.layer_types``.
    """

    def __init__(self, config: ModelConfig, group: TPGroup, dtype: torch.dtype, layer_idx: int = 0) -> None:
        super().__init__()
        d = config.head_dim
        self.layer_type = config.layer_type(layer_idx)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, group, config.attention_bias, dtype)
        self.o_proj = RowParallelLinear(self.qkv_proj.num_heads_padded * d, config.hidden_size, group,
                                        bias=config.o_proj_bias, reduce_results=True,
                                        org_input_size=config.num_attention_heads * d, dtype=dtype,
                                        reduction_unit=d if config.tp_invariant else None)  # one unit per head
        self.rotary_emb = RotaryEmbedding(config, self.layer_type)
        scale = config.attention_scale if config.attention_scale is not None else d ** -0.5
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d, scale,
                              sliding_window=config.layer_sliding_window(layer_idx),
                              logit_softcap=config.attn_logit_softcapping)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook before RoPE (identity here; per-head norms in Qwen3 and Gemma 3)."""
        return q, k

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``[T, hidden] -> [T, hidden]`` (replicated).

        Fixed-order CPU path: RoPE, the KV-cache write and attention through
        :meth:`Attention.forward_rotary` (the same bits as the steps below).
        """
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))  # q: [T, Hl, D], k/v: [T, Kl, D]
        q, k = self.qk_norm(q, k)
        if self.attn.fuses_rotary(q):
            cos, sin = self.rotary_emb.cos_sin(positions, q.dtype)
            return self.o_proj(self.attn.forward_rotary(q, k, v, cos, sin, meta))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))  # [T, Hl*D] -> [T, hidden]


#: The gate activation of the gated MLP, by HF ``hidden_act`` name.
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
#: The same activations as :func:`~tpguide.kernels.fixed_order_cpu.unary_fixed_order` op names.
FIXED_ORDER_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class LlamaMLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``; SiLU (Llama) or tanh-GELU (Gemma's GeGLU).

    ``intermediate_size`` (default ``config.intermediate_size``) sets another
    width: one expert of a mixture of experts (:mod:`tpguide.model.moe`).
    """

    def __init__(self, config: ModelConfig, group: TPGroup, dtype: torch.dtype,
                 intermediate_size: Optional[int] = None) -> None:
        super().__init__()
        i = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [i, i], group, config.mlp_bias, dtype)
        self.down_proj = RowParallelLinear(i, config.hidden_size, group, bias=config.mlp_bias,
                                           reduce_results=True, dtype=dtype,
                                           reduction_unit=(reduction_block_size(i, group.tp_size)
                                                           if config.tp_invariant else None))
        self.act_fn = ACTIVATIONS[config.hidden_act]
        self.act_name = FIXED_ORDER_ACTIVATIONS[config.hidden_act]

    #: Set by a TP-invariant model: on CPU the activation by scalar libm calls
    #: (:func:`~tpguide.kernels.fixed_order_cpu.unary_fixed_order`), the same for every element;
    #: fp32 and bf16 in one pass over the merged output (:func:`~tpguide.kernels.fused_cpu.act_and_mul`,
    #: vLLM's ``SiluAndMul``), the bits of ``unary_fixed_order(gate).to(dtype) * up``.
    fixed_order: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden] -> [T, hidden]`` (replicated)."""
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[T, 2 * I/T] -> [T, I/T]``: ``act(gate) * up`` of this rank's columns, the model dtype."""
        if self.act_name == "silu" and use_triton(gate_up):  # the CUDA path: one launch (docs/gpu.md)
            from tpguide.kernels.silu_and_mul_triton import silu_and_mul_triton

            return silu_and_mul_triton(gate_up)
        if self.fixed_order and takes(gate_up) and not use_triton(gate_up):
            return act_and_mul(gate_up, self.act_name)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I/T] each
        if self.fixed_order and not gate.is_cuda:
            return unary_fixed_order(gate, self.act_name).to(gate.dtype) * up
        return self.act_fn(gate) * up


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block.

    :class:`LlamaModel` runs it vLLM-style through :meth:`forward_residual`,
    carrying the residual stream so that each residual add is fused with the
    norm after it (:meth:`RMSNorm.forward` with ``residual``); :meth:`forward`
    is the same block as one function of ``x``.
    """

    attention_cls = LlamaAttention
    norm_cls = RMSNorm
    #: The layer runs through :meth:`forward_residual` (False: a subclass with another
    #: block structure, e.g. Gemma 2's four norms, overrides :meth:`forward` only).
    carries_residual = True

    def __init__(self, config: ModelConfig, group: TPGroup, dtype: torch.dtype, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = self.attention_cls(config, group, dtype, layer_idx)
        self.post_attention_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = self.make_mlp(config, group, dtype, layer_idx)

    def make_mlp(self, config: ModelConfig, group: TPGroup, dtype: torch.dtype, layer_idx: int) -> nn.Module:
        """The layer's feed-forward block (a mixture of experts overrides it, :mod:`tpguide.model.moe`)."""
        return LlamaMLP(config, group, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``[T, hidden] -> [T, hidden]``: ``x + attn(norm(x))``, then ``+ mlp(norm(.))``."""
        hidden, residual = self.forward_residual(positions, x, None, meta)
        return hidden + residual

    def forward_residual(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                         meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The block with the residual carried (vLLM's decoder layers): ``(mlp_out, residual)``.

        The layer's input is ``hidden + residual`` (``hidden`` alone for the
        first layer, ``residual`` None); it returns the MLP output and the
        residual before it, whose sum is the layer's output (:meth:`forward`),
        the add left to the next norm.  All ``[T, hidden]``, the model dtype.
        """
        if residual is None:
            residual, h = hidden, self.input_layernorm(hidden)
        else:
            h, residual = self.input_layernorm(hidden, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(positions, h, meta), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm."""

    decoder_layer_cls = LlamaDecoderLayer
    embedding_cls = VocabParallelEmbedding

    def __init__(self, config: ModelConfig, group: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = self.embedding_cls(config.org_vocab_size, config.hidden_size, group, dtype)
        self.layers = nn.ModuleList(self.decoder_layer_cls(config, group, dtype, i)
                                    for i in range(config.num_hidden_layers))
        shared_rope: Dict[str, nn.Module] = {}
        for layer in self.layers:  # one RoPE table per layer type: cos/sin once per step
            attn = layer.self_attn
            attn.rotary_emb = shared_rope.setdefault(attn.layer_type, attn.rotary_emb)
        self.norm = self.decoder_layer_cls.norm_cls(config.hidden_size, config.rms_norm_eps, dtype)

    #: Run qualifying layers as one C call on CPU (:mod:`tpguide.model.decoder_stack_cpu`); False: per op.
    use_decoder_stack: bool = True

    def decoder_stack_cpu(self):
        """The layers as one C call (:class:`~tpguide.model.decoder_stack_cpu.DecoderStackCPU`), or None."""
        if not self.use_decoder_stack:
            return None
        if not hasattr(self, "_decoder_stack"):
            self._decoder_stack = DecoderStackCPU.of(self, (LlamaDecoderLayer, LlamaAttention, LlamaMLP))
        return self._decoder_stack

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        if not self.decoder_layer_cls.carries_residual:
            for layer in self.layers:
                x = layer(positions, x, meta)
            return self.norm(x)
        residual = None
        stack = self.decoder_stack_cpu()
        done = None if stack is None else stack.run(positions, x, meta)
        if done is not None:  # the same kernels in one C call (docs/architecture.md §6)
            return self.norm(*done)[0]
        for layer in self.layers:  # the residual carried: add + norm in one call (docs/architecture.md §6)
            x, residual = layer.forward_residual(positions, x, residual, meta)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """One rank's shard of a Llama-family causal LM (the base of every supported family).

    Parameters
    ----------
    config : ModelConfig
    group : TPGroup
        This rank's TP group; parameters are created on ``group.device``.
    dtype : torch.dtype
        Parameter and activation dtype (logits are always fp32).
    tokenizer_vocab_size : int, optional
        Ids ``>= tokenizer_vocab_size`` get ``-inf`` logits too.
    tp_invariant : bool
        Every reduction in a fixed order: row-parallel layers over fixed units
        (heads, blocks of the intermediate dim), matmuls, attention and norms
        through fixed-order kernels, so a row's logits are bit-identical at tp
        1, 2, 3, 4, at any thread count and beside any other rows
        (:mod:`tpguide.model.invariant_reduce`); False: the plain library
        kernels and all-reduce (identical only up to rounding).

    Attributes
    ----------
    vocab_shard : VocabShard
        This rank's slice of the padded vocabulary.

    Raises
    ------
    ValueError
        If the model cannot run at ``group.tp_size`` (lists the valid sizes).

    Weights are zero (norms one) until loaded (:func:`tpguide.model.loader.load_model`).
    """

    model_cls = LlamaModel

    def __init__(self, config: ModelConfig, group: TPGroup, dtype: torch.dtype = torch.float32,
                 tokenizer_vocab_size: Optional[int] = None, tp_invariant: bool = True) -> None:
        super().__init__()
        config.check_tp_size(group.tp_size)
        config = dataclasses.replace(config, tp_invariant=tp_invariant)  # read by the row-parallel layers
        self.config, self.group, self.dtype, self.tp_invariant = config, group, dtype, tp_invariant
        with torch.device(group.device):
            self.model = self.model_cls(config, group, dtype)
        with torch.device("meta" if config.tie_word_embeddings else group.device):  # tied: its own matrix unused
            self.lm_head = ParallelLMHead(config.org_vocab_size, config.hidden_size, group, dtype,
                                          tokenizer_vocab_size=tokenizer_vocab_size,
                                          logit_softcap=config.final_logit_softcapping)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if tp_invariant:  # every reduction in a fixed order (docs/architecture.md §6, "Fixed-order reductions")
            for module in self.modules():
                if hasattr(type(module), "fixed_order"):
                    module.fixed_order = True
        self.vocab_shard: VocabShard = self.lm_head.vocab_shard

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads on this rank (padded)."""
        return self.model.layers[0].self_attn.qkv_proj.num_kv_heads

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block of the allocated pool (raises RuntimeError before ``allocate_kv_cache``)."""
        cache = self.model.layers[0].self_attn.attn.k_cache
        if cache is None:
            raise RuntimeError("KV cache not allocated: call allocate_kv_cache(num_blocks, block_size)")
        return int(cache.size(1))

    def kv_cache_block_bytes(self, block_size: int) -> int:
        """Bytes one KV block of ``block_size`` tokens takes on this rank (k and v, every layer, model dtype)."""
        per_token = 2 * self.num_local_kv_heads * self.config.head_dim * torch.empty((), dtype=self.dtype).element_size()
        return per_token * block_size * len(self.model.layers)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, max_model_len: Optional[int] = None) -> None:
        """Allocate zeroed per-layer block pools ``[num_blocks, block_size, num_local_kv_heads, head_dim]``.

        docs/architecture.md §7 "KV cache".  Model dtype, on ``group.device``;
        replaces any previous cache.  On the CPU the pages are zeroed by the
        kernel on first touch (:func:`~tpguide.model.zeroed_pool.zeroed_pool`).  ``max_model_len`` (default
        ``block_size``, the dense case: one block per slot) fixes longrope's
        factor set for this cache (see :mod:`tpguide.model.rotary`).

        Raises
        ------
        ValueError
            If a size is < 1 or ``max_model_len > max_position_embeddings``.
        MemoryError
            On the CPU, a whole pool (every layer's K and V) larger than the
            system's available memory (:func:`~tpguide.model.zeroed_pool.check_pool_fits_memory`).
        """
        max_model_len = block_size if max_model_len is None else max_model_len
        if num_blocks < 1 or block_size < 1 or max_model_len < 1:
            raise ValueError(f"num_blocks, block_size and max_model_len must be >= 1, got {num_blocks}, "
                             f"{block_size}, {max_model_len}")
        if max_model_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} > max_position_embeddings={self.config.max_position_embeddings}"
            )
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.set_max_model_len(max_model_len)  # longrope picks its factors per cache length
        shape = (num_blocks, block_size, self.num_local_kv_heads, self.config.head_dim)
        for layer in self.model.layers:
            layer.self_attn.attn.k_cache = None  # free the old pool before the new one is allocated
            layer.self_attn.attn.v_cache = None
        if self.group.device.type == "cpu":  # once, for the whole pool: each layer's share alone would always fit
            check_pool_fits_memory(num_blocks * self.kv_cache_block_bytes(block_size),
                                   f"{num_blocks} blocks of {block_size} tokens, {len(self.model.layers)} layers")
        for layer in self.model.layers:
            layer.self_attn.attn.k_cache = zeroed_pool(shape, self.dtype, self.group.device)  # CPU: zeroed on touch
            layer.self_attn.attn.v_cache = zeroed_pool(shape, self.dtype, self.group.device)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Run the decoder on a flattened mixed batch; fills the KV cache.

        Parameters
        ----------
        input_ids, positions : torch.Tensor
            int64 ``[T]`` on ``group.device``; ``positions`` are absolute
            (``context_len + i``), consistent with ``attn_metadata``.
        attn_metadata : AttentionMetadata

        Returns
        -------
        torch.Tensor
            ``[T, hidden_size]`` model dtype, identical on every rank.
        """
        return self.model(input_ids, positions, attn_metadata)

    @torch.no_grad()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[R, hidden_size]`` -> this rank's fp32 logits shard ``[R, padded_vocab_size // tp_size]``.

        Column ``j`` is token ``vocab_start_index + j``; padded ids and ids the
        tokenizer cannot produce are ``-inf``.  No communication.
        """
        return self.lm_head.compute_logits(hidden_states)
