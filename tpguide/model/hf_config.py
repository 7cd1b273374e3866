"""Translate a transformers config of a supported family into :class:`~tpguide.model.config.ModelConfig` fields.

What differs per family (HF field names)::

    family     qkv / o bias           q/k norm  act (gate)           attention scale            extras
    Llama      attention_bias         no        hidden_act           head_dim**-0.5             mlp_bias
    Mistral    no                     no        hidden_act           head_dim**-0.5             sliding_window (all layers)
    Qwen2      yes / no               no        hidden_act           head_dim**-0.5             layer_types (use_sliding_window)
    Qwen3      attention_bias         yes       hidden_act           head_dim**-0.5             layer_types (use_sliding_window)
    Phi3       no                     no        hidden_act           head_dim**-0.5             fused qkv/gate_up; sliding_window
    Gemma2     attention_bias         no        hidden_activation    query_pre_attn_scalar**-.5 (1+w) norms, soft-caps, layer_types
    Gemma3     attention_bias         yes       hidden_activation    query_pre_attn_scalar**-.5 (1+w) norms, RoPE per layer type
    Qwen3Moe   attention_bias         yes       hidden_act           head_dim**-0.5             experts: num_experts, moe_intermediate_size,
                                                                                                norm_topk_prob, decoder_sparse_step, mlp_only_layers
    Mixtral    no                     no        hidden_act           head_dim**-0.5             experts: num_local_experts (width intermediate_size,
                                                                                                top-k renormalised, fp32 weights); sliding_window

Unsupported configurations (other mixtures of experts, other families,
bidirectional attention) raise one ``ValueError`` line naming the feature and
listing what is supported, before any weight is read.
"""

from __future__ import annotations

from typing import Any, Dict

#: HF ``architectures`` of mixtures of experts this package runs (docs/models.md, "Mixtures of experts").
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
#: HF ``architectures`` entries this package runs (text-only decoders).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM") + MOE_ARCHITECTURES

#: ``model_type`` -> architecture, for configs without ``architectures``.
ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
}
#: Multimodal architectures whose text decoder runs (images refused): name -> the text architecture.
TEXT_DECODER_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
#: Config fields that mark a mixture-of-experts model (transformers' names across families).
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def architecture_of(hf_config: Any) -> str:
    """The HF architecture name (first ``architectures`` entry, else from ``model_type``)."""
    archs = getattr(hf_config, "architectures", None) or []
    model_type = getattr(hf_config, "model_type", None)
    return archs[0] if archs else ARCHITECTURE_BY_MODEL_TYPE.get(model_type, str(model_type))


def check_supported(hf_config: Any) -> str:
    """Return the architecture name, or raise the one-line startup error.

    Raises
    ------
    ValueError
        ``"unsupported model: <what> ...; supported architectures: ..."`` for a
        mixture-of-experts config or an architecture not in
        :data:`SUPPORTED_ARCHITECTURES`.
    """
    arch = architecture_of(hf_config)
    supported = ", ".join(SUPPORTED_ARCHITECTURES + tuple(f"{k} (text only)" for k in TEXT_DECODER_OF))
    experts = {f: getattr(hf_config, f) for f in MOE_FIELDS if (getattr(hf_config, f, None) or 0) > 0}
    if arch not in MOE_ARCHITECTURES and (experts or "moe" in arch.lower() or "mixtral" in arch.lower()):
        shown = ", ".join(f"{k}={v}" for k, v in experts.items()) or "expert layers"
        raise ValueError(f"unsupported model: {arch} is a mixture-of-experts model ({shown}); "
                         f"the mixtures of experts tpguide runs are {', '.join(MOE_ARCHITECTURES)}; "
                         f"supported architectures: {supported}")
    if arch not in SUPPORTED_ARCHITECTURES and arch not in TEXT_DECODER_OF:
        raise ValueError(f"unsupported model: architecture {arch!r}; supported architectures: {supported}")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError(f"unsupported model: {arch} with use_bidirectional_attention=True; "
                         "only causal attention is supported")
    return arch


def _layer_types(hf_config: Any, num_layers: int) -> tuple:
    if getattr(hf_config, "use_sliding_window", None) is False:  # Qwen2/3: a sliding_window value alone is inert
        return ()
    types = getattr(hf_config, "layer_types", None)
    if types:
        return tuple(types)
    if getattr(hf_config, "sliding_window", None) is not None:  # Mistral, Phi-3: every layer
        return ("sliding_attention",) * num_layers
    return ()


def _rope_parameters(hf_config: Any, arch: str) -> Dict[str, Any]:
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    if arch == "Gemma3ForCausalLM":
        return {k: dict(v) for k, v in rope.items()}
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return rope


def _expert_kwargs(hf_config: Any, arch: str, num_layers: int) -> Dict[str, Any]:
    """The mixture-of-experts fields of :class:`~tpguide.model.config.ModelConfig` (none for a dense family)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    num_experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", 0)
    if arch == "MixtralForCausalLM":  # every layer sparse, experts of intermediate_size, top-k renormalised in fp32
        return dict(num_experts=num_experts, num_experts_per_tok=hf_config.num_experts_per_tok,
                    moe_intermediate_size=hf_config.intermediate_size, norm_topk_prob=True,
                    moe_layers=tuple(range(num_layers)), router_weights_fp32=True)
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    sparse = tuple(i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    return dict(num_experts=num_experts, num_experts_per_tok=hf_config.num_experts_per_tok,
                moe_intermediate_size=hf_config.moe_intermediate_size,
                norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)), moe_layers=sparse)


def model_config_kwargs(hf_config: Any) -> Dict[str, Any]:
    """Keyword arguments of :class:`~tpguide.model.config.ModelConfig` for ``hf_config``.

    Parameters
    ----------
    hf_config : transformers.PretrainedConfig or SimpleNamespace
        The model's config (a namespace of a plain ``config.json`` works for
        Llama, Mistral and Qwen2 without a window).

    Raises
    ------
    ValueError
        See :func:`check_supported`.
    """
    arch = check_supported(hf_config)
    if arch in TEXT_DECODER_OF:  # e.g. gemma-3-4b-it: run its language model on text
        text = hf_config.text_config
        text.architectures = [TEXT_DECODER_OF[arch]]
        if getattr(hf_config, "tie_word_embeddings", None) is not None:
            text.tie_word_embeddings = hf_config.tie_word_embeddings
        kwargs = model_config_kwargs(text)
        kwargs["text_decoder_of"] = arch
        return kwargs
    bias = bool(getattr(hf_config, "attention_bias", False))
    qkv_bias, o_bias = {"Qwen2ForCausalLM": (True, False), "MistralForCausalLM": (False, False),
                        "MixtralForCausalLM": (False, False), "Phi3ForCausalLM": (False, False)}.get(arch, (bias, bias))
    num_layers = hf_config.num_hidden_layers
    layer_types = _layer_types(hf_config, num_layers)
    gemma = arch in _GEMMA
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kwargs: Dict[str, Any] = dict(
        architecture=arch,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hf_config.num_attention_heads,
        num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        max_position_embeddings=hf_config.max_position_embeddings,
        org_vocab_size=hf_config.vocab_size,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        o_proj_bias=o_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)) if arch == "LlamaForCausalLM" else False,
        hidden_act=(getattr(hf_config, "hidden_activation", None) if gemma else None)
        or getattr(hf_config, "hidden_act", "silu"),
        rope_parameters=_rope_parameters(hf_config, arch),
        layer_types=layer_types,
        sliding_window=getattr(hf_config, "sliding_window", None) if "sliding_attention" in layer_types else None,
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
        hf_config=hf_config,
        **_expert_kwargs(hf_config, arch, num_layers),
    )
    if gemma:
        kwargs.update(
            attention_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
            attn_logit_softcapping=getattr(hf_config, "attn_logit_softcapping", None),
            final_logit_softcapping=getattr(hf_config, "final_logit_softcapping", None),
            embed_scale=float(hf_config.hidden_size) ** 0.5,
        )
    return kwargs
