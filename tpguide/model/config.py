"""The model configuration: the numbers a decoder of a supported family needs.

:class:`ModelConfig` is read from a Hugging Face ``config.json`` (Llama,
Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3 text, and the mixtures of
experts Qwen3-MoE and Mixtral; SmolLM2 is a Llama) and
validated once; :mod:`tpguide.model.hf_config` translates the per-family
transformers fields.  It also owns the
head-padding arithmetic that decides which ``tp_size`` values a model
supports (:func:`pad_heads`, :meth:`ModelConfig.check_tp_size`).

Head padding (docs/architecture.md §7): when ``num_key_value_heads`` does not divide by
``tp_size``, zero KV heads are appended, each with its whole group of
``num_attention_heads // num_key_value_heads`` zero query heads, until the KV
head count divides.  SmolLM2-135M (9 query heads, 3 KV heads, group 3)::

    tp_size   KV heads (padded)   per rank: KV heads, q heads
    1         3                   3, 9
    2         4  (+1 zero group)  2, 6
    3         3                   1, 3
    4         4  (+1 zero group)  1, 3

Padding is always used, also where vLLM would replicate KV heads
(``tp_size % num_key_value_heads == 0``): one rule for every case, and a group
is never split across ranks.  The cost is idle zero heads on some ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Optional, Tuple

import torch

from tpguide.model.hf_config import SUPPORTED_ARCHITECTURES, model_config_kwargs

#: RoPE types: fixed inverse frequencies, or ``longrope`` (short/long factors chosen per sequence length).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
#: MLP activations (HF ``hidden_act`` / ``hidden_activation`` names).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
#: Values of HF ``layer_types`` this package implements.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
#: Largest ``tp_size`` listed by :meth:`ModelConfig.valid_tp_sizes`.
MAX_LISTED_TP_SIZE = 16


#: Fields a ``config.json`` must spell out to be read without transformers.
_PLAIN_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
               "vocab_size", "tie_word_embeddings", "hidden_act", "rope_parameters")
#: Per model type, fields whose transformers default matters and must be explicit.
_PLAIN_KEYS_BY_TYPE = {"llama": ("attention_bias", "mlp_bias"), "mistral": ("sliding_window",),
                       "qwen2": ("use_sliding_window",)}


def _is_plain_config(raw: Dict[str, Any]) -> bool:
    """True if ``raw`` (a parsed config.json) can be used as is: every field explicit, default RoPE, no window."""
    extra = _PLAIN_KEYS_BY_TYPE.get(raw.get("model_type"))
    if extra is None or any(k not in raw for k in _PLAIN_KEYS + extra):
        return False
    if raw.get("use_sliding_window") or (raw["model_type"] == "mistral" and raw["sliding_window"] is not None):
        return False
    if "layer_types" in raw:
        return False
    rope = raw["rope_parameters"] or {}
    return rope.get("rope_type") == "default" and "rope_theta" in rope and not raw.get("rope_scaling")


def pad_heads(num_attention_heads: int, num_key_value_heads: int, tp_size: int) -> Tuple[int, int]:
    """Head counts after zero-padding whole KV groups to a multiple of ``tp_size``.

    Returns
    -------
    (num_heads_padded, num_kv_heads_padded) : tuple of int
        ``num_kv_heads_padded = ceil(num_key_value_heads / tp_size) * tp_size``;
        ``num_heads_padded = num_kv_heads_padded * group`` where
        ``group = num_attention_heads // num_key_value_heads``.
    """
    group = num_attention_heads // num_key_value_heads
    kv_padded = -(-num_key_value_heads // tp_size) * tp_size
    return kv_padded * group, kv_padded


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Attributes
    ----------
    architecture : str
        One of :data:`SUPPORTED_ARCHITECTURES`.
    hidden_size, intermediate_size, num_hidden_layers : int
    num_attention_heads, num_key_value_heads, head_dim : int
        Unpadded (checkpoint) head counts; ``head_dim`` in elements.
    rms_norm_eps : float
    max_position_embeddings : int
        Tokens.
    org_vocab_size : int
        Rows of the checkpoint's embedding / LM head (HF ``vocab_size``).
    tie_word_embeddings : bool
        The LM head shares the embedding weight.
    attention_bias : bool
        q/k/v projections carry a bias (Qwen2: always; Llama: ``attention_bias``).
    o_proj_bias : bool
        The output projection carries a bias (Llama with ``attention_bias`` only).
    mlp_bias : bool
        gate/up/down projections carry a bias (Llama ``mlp_bias``).
    hidden_act : str
        One of :data:`SUPPORTED_ACTIVATIONS` (the gate of the gated MLP).
    rope_parameters : dict
        HF ``rope_parameters`` (``rope_type``, ``rope_theta``, scaling keys,
        ``partial_rotary_factor``); for Gemma 3 one such dict per layer type
        (``{"full_attention": {...}, "sliding_attention": {...}}``).
    layer_types : tuple of str
        Per layer, ``"full_attention"`` or ``"sliding_attention"``; empty means
        all full.
    sliding_window : int or None
        Tokens a sliding layer's query sees, itself included (key ``j`` is
        visible from query ``i`` iff ``i - sliding_window < j <= i``, as
        transformers' ``sliding_window_overlay``).
    qk_norm : bool
        Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    attention_scale : float or None
        Softmax scale; ``None`` means ``head_dim ** -0.5`` (Gemma:
        ``query_pre_attn_scalar ** -0.5``).
    attn_logit_softcapping, final_logit_softcapping : float or None
        ``cap * tanh(x / cap)`` on attention scores / on the LM head's logits
        (Gemma 2).
    embed_scale : float
        Multiplies the embedding output (Gemma: ``sqrt(hidden_size)``).
    num_experts : int
        Routed experts of a mixture-of-experts layer (0: a dense model).
    num_experts_per_tok : int
        Experts each token is routed to (top-k).
    moe_intermediate_size : int
        Each expert's gated-MLP width (Mixtral: ``intermediate_size``).
    norm_topk_prob : bool
        The top-k routing weights are divided by their sum (Mixtral: always).
    moe_layers : tuple of int
        The layers whose MLP is the expert block (the others are dense MLPs
        of ``intermediate_size``; Qwen3-MoE's ``decoder_sparse_step`` /
        ``mlp_only_layers``).
    router_weights_fp32 : bool
        The routing weights stay fp32 when they weight the expert outputs
        (Mixtral); False: rounded to the model dtype first (Qwen3-MoE).
    text_decoder_of : str or None
        The multimodal architecture (``Gemma3ForConditionalGeneration``)
        whose language model this is; its checkpoint names carry a prefix
        and its vision tensors are skipped (:mod:`tpguide.model.gemma3`).
    hf_config : transformers.PretrainedConfig or None
        Kept for the RoPE init functions of transformers; not compared.
    tp_invariant : bool
        Not from the checkpoint: set by :class:`~tpguide.model.llama.LlamaForCausalLM`.
        Row-parallel layers reduce over fixed units (docs/architecture.md §6).

    Raises
    ------
    ValueError
        On an unsupported architecture, activation or RoPE type, or
        inconsistent sizes (each message names the values).
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    org_vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rope_parameters: Dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    layer_types: Tuple[str, ...] = ()
    sliding_window: Optional[int] = None
    qk_norm: bool = False
    attention_scale: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    embed_scale: float = 1.0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: Tuple[int, ...] = ()
    router_weights_fp32: bool = False
    text_decoder_of: Optional[str] = None
    tp_invariant: bool = True
    hf_config: Optional[Any] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture must be one of {SUPPORTED_ARCHITECTURES}, got {self.architecture!r}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {SUPPORTED_ACTIVATIONS}, got {self.hidden_act!r}")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "org_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"num_hidden_layers={self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - set(SUPPORTED_LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported; supported: {SUPPORTED_LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and (self.sliding_window or 0) < 1:
            raise ValueError(f"sliding_attention layers need sliding_window >= 1, got {self.sliding_window}")
        self._check_experts()
        for layer_type in sorted(set(self.layer_types) or {"full_attention"}):
            rope_type = self.rope_params(layer_type).get("rope_type", "default")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
            if rope_type != "default" and self.hf_config is None:
                raise ValueError(f"rope_type={rope_type!r} needs hf_config (the transformers config object)")

    def _check_experts(self) -> None:
        if not self.num_experts:
            if self.moe_layers:
                raise ValueError(f"moe_layers={list(self.moe_layers)} needs num_experts >= 1")
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                             f"{self.num_experts}]")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")
        outside = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
        if outside:
            raise ValueError(f"moe_layers {outside} outside [0, num_hidden_layers={self.num_hidden_layers})")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s MLP is the mixture-of-experts block."""
        return layer_idx in self.moe_layers

    # ------------------------------------------------------------------ build
    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        """Build from a ``transformers`` config.

        See :func:`tpguide.model.hf_config.model_config_kwargs` for the
        per-family translation.

        Raises
        ------
        ValueError
            An unsupported architecture (MoE, unknown family) or feature; one
            line naming it and listing what is supported.
        """
        return cls(**model_config_kwargs(hf_config))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        """Read ``config.json`` from a local directory.

        A complete, plain config (every field explicit, default RoPE) is read
        with ``json`` alone: importing transformers costs each rank seconds.
        Anything else goes through ``transformers.AutoConfig``, which fills
        defaults and converts old RoPE formats.

        Raises
        ------
        ValueError
            If the directory or its ``config.json`` is missing, or the config
            is unsupported.
        """
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"no config.json in model directory {str(model_dir)!r}")
        raw = json.loads((model_dir / "config.json").read_text())
        if _is_plain_config(raw):
            return cls.from_hf(SimpleNamespace(**raw))
        from transformers import AutoConfig

        return cls.from_hf(AutoConfig.from_pretrained(model_dir, local_files_only=True))

    # ---------------------------------------------------------------- derived
    def layer_type(self, layer_idx: int) -> str:
        """``"full_attention"`` or ``"sliding_attention"`` of layer ``layer_idx``."""
        return self.layer_types[layer_idx] if self.layer_types else "full_attention"

    def layer_sliding_window(self, layer_idx: int) -> Optional[int]:
        """The window (tokens) of layer ``layer_idx``, or None for full attention."""
        return self.sliding_window if self.layer_type(layer_idx) == "sliding_attention" else None

    def rope_params(self, layer_type: str = "full_attention") -> Dict[str, Any]:
        """The RoPE parameters of ``layer_type`` (the one dict unless they differ per layer type)."""
        if layer_type in self.rope_parameters and isinstance(self.rope_parameters[layer_type], dict):
            return self.rope_parameters[layer_type]
        return self.rope_parameters

    @property
    def per_layer_type_rope(self) -> bool:
        """True if ``rope_parameters`` holds one dict per layer type (Gemma 3)."""
        return any(isinstance(v, dict) for v in self.rope_parameters.values())

    def rotary_dim(self, layer_type: str = "full_attention") -> int:
        """Rotated elements of each head: ``int(head_dim * partial_rotary_factor)``."""
        return int(self.head_dim * float(self.rope_params(layer_type).get("partial_rotary_factor", 1.0)))

    def padded_heads(self, tp_size: int) -> Tuple[int, int]:
        """``(num_heads_padded, num_kv_heads_padded)`` at ``tp_size``; see :func:`pad_heads`."""
        return pad_heads(self.num_attention_heads, self.num_key_value_heads, tp_size)

    def _tp_size_problem(self, tp_size: int) -> Optional[str]:
        if tp_size < 1:
            return f"tp_size must be >= 1, got {tp_size}"
        if len(self.moe_layers) < self.num_hidden_layers and self.intermediate_size % tp_size:
            return f"intermediate_size={self.intermediate_size} is not divisible by tp_size={tp_size}"
        if self.moe_layers and self.moe_intermediate_size % tp_size:
            return f"moe_intermediate_size={self.moe_intermediate_size} is not divisible by tp_size={tp_size}"
        return None

    def valid_tp_sizes(self, up_to: int = MAX_LISTED_TP_SIZE) -> list[int]:
        """The ``tp_size`` values in ``[1, up_to]`` this model runs at."""
        return [t for t in range(1, up_to + 1) if self._tp_size_problem(t) is None]

    def check_tp_size(self, tp_size: int) -> None:
        """Raise ``ValueError`` naming the valid sizes if the model cannot run at ``tp_size``.

        Attention heads always fit (zero-padded, see the module docstring);
        the MLP's ``intermediate_size`` (and each expert's
        ``moe_intermediate_size``) must divide by ``tp_size``.
        """
        problem = self._tp_size_problem(tp_size)
        if problem is not None:
            raise ValueError(
                f"{problem}; valid tp sizes for this model (up to {MAX_LISTED_TP_SIZE}): "
                f"{self.valid_tp_sizes()}"
            )

    def rope_inv_freq(self, device: Optional[torch.device] = None, layer_type: str = "full_attention",
                      seq_len: Optional[int] = None) -> Tuple[torch.Tensor, float]:
        """RoPE inverse frequencies and the cos/sin scale, exactly as transformers computes them.

        Parameters
        ----------
        layer_type : str
            Selects the parameters where they differ per layer type (Gemma 3).
        seq_len : int, optional
            Sequence length (tokens); ``longrope`` returns its long factors
            when it exceeds ``original_max_position_embeddings``.

        Returns
        -------
        inv_freq : torch.Tensor
            fp32 ``[rotary_dim // 2]`` (radians per position).
        attention_scaling : float
            Multiplies cos and sin (1.0 except for yarn and longrope).

        Uses ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` for the
        scaled types; the default type follows
        ``LlamaRotaryEmbedding.compute_default_rope_parameters`` (with
        Phi-3's ``partial_rotary_factor``).
        """
        params = self.rope_params(layer_type)
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = float(params["rope_theta"])
            dim = self.rotary_dim(layer_type)
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
            return inv_freq, 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kwargs: Dict[str, Any] = {"layer_type": layer_type} if self.per_layer_type_rope else {}
        if seq_len is not None:
            kwargs["seq_len"] = seq_len
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.hf_config, device, **kwargs)
        return inv_freq.float(), float(scaling)
