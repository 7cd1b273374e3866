"""Tiny random-weight checkpoints of every supported family, for tests and benchmarks.

:func:`write_random_checkpoint` builds transformers' own ``LlamaForCausalLM``
with random weights and ``save_pretrained``-s it, so the directory is a real
HF checkpoint (``config.json``, ``model.safetensors``) that transformers and
tpguide both load.  :func:`write_random_model` does the same for any
transformers config (``AutoModelForCausalLM.from_config``), and
:func:`tiny_hf_config` gives a tiny config per supported architecture that
exercises its features (sliding windows, soft-caps, longrope, partial rotary,
q/k norms, head padding at tp 3 and 4).  Default shape mimics SmolLM2's head layout (9 query heads,
3 KV heads) at a toy width so every ``tp_size`` path (padding at 2 and 4,
exact at 3) is exercised in seconds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch

#: Files copied from ``tokenizer_dir`` when present.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json",
)
#: Std of the random weights: large enough that greedy argmax has no near-ties.
INIT_STD = 0.15


def write_random_checkpoint(
    out_dir: str | Path,
    *,
    vocab_size: int = 49152,
    hidden_size: int = 144,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 9,
    num_key_value_heads: int = 3,
    head_dim: Optional[int] = None,
    intermediate_size: int = 192,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
    attention_bias: bool = False,
    rope_theta: float = 10000.0,
    seed: int = 0,
    tokenizer_dir: Optional[str | Path] = None,
) -> Path:
    """Write a random-weight Llama HF directory to ``out_dir`` and return its path.

    Parameters
    ----------
    out_dir : str or Path
        Created if missing; existing files of the same names are overwritten.
    vocab_size ... rope_theta
        ``LlamaConfig`` fields (``vocab_size`` becomes ``org_vocab_size``).
        transformers requires ``hidden_size % num_attention_heads == 0``;
        ``head_dim`` defaults to their quotient (16 here).
    seed : int
        Seeds the weights: same arguments, same checkpoint.
    tokenizer_dir : str or Path, optional
        A directory (e.g. :func:`tpguide.model.default_model.default_model_dir`)
        whose tokenizer files and ``generation_config.json`` are copied, and
        whose ``config.json`` special-token ids are reused.

    Returns
    -------
    Path
        ``out_dir``.

    Norm weights and biases are randomised too (transformers initialises
    them to one / zero), so a mis-mapped norm or bias is caught by tests.
    """
    from transformers import LlamaConfig

    special = _special_token_ids(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim or hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=attention_bias,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        initializer_range=INIT_STD,
        **special,
    )
    config.architectures = ["LlamaForCausalLM"]
    return write_random_model(out_dir, config, seed=seed, tokenizer_dir=tokenizer_dir)


def _special_token_ids(tokenizer_dir: Optional[str | Path]) -> dict:
    if tokenizer_dir is None or not (Path(tokenizer_dir) / "config.json").is_file():
        return {}
    src = json.loads((Path(tokenizer_dir) / "config.json").read_text())
    return {k: src[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in src}


def write_random_model(out_dir: str | Path, config, *, seed: int = 0, tokenizer_dir: Optional[str | Path] = None,
                       dtype: torch.dtype = torch.float32, max_shard_size: Optional[str] = None) -> Path:
    """Save ``AutoModelForCausalLM.from_config(config)`` with random weights (norms and biases too) to ``out_dir``.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        Its ``architectures`` is set from the built model's class.
    seed : int
    tokenizer_dir : str or Path, optional
        Tokenizer files and ``generation_config.json`` copied from here.
    dtype : torch.dtype
        Dtype of the saved tensors.
    max_shard_size : str, optional
        E.g. ``"200KB"``: a sharded checkpoint with ``model.safetensors.index.json``.

    Returns
    -------
    Path
        ``out_dir``.
    """
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                centre = 0.0 if torch.all(p == 0) else 1.0  # Gemma norms store w of (1 + w)
                p.copy_(centre + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.config.architectures = [type(model).__name__]
    model.to(dtype).save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tokenizer_dir is not None:
        for fname in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / fname
            if src.is_file():
                shutil.copyfile(src, out_dir / fname)
    return out_dir


#: Shapes shared by :func:`tiny_hf_config`: 4 query heads in 2 KV groups (zero-padded KV groups at tp 3
#: and 4), an MLP width that divides by 1..4, and a window shorter than the test prompts.
TINY_SHAPES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=INIT_STD)
TINY_SLIDING_WINDOW = 8


def tiny_hf_config(architecture: str, vocab_size: int, tokenizer_dir: Optional[str | Path] = None, **overrides):
    """A tiny transformers config of ``architecture`` that switches on what the family has.

    ============================  ===========================================================
    ``MistralForCausalLM``        sliding window on every layer, untied head
    ``Qwen2ForCausalLM``          qkv bias, sliding window on layer 1 (``max_window_layers``)
    ``Qwen3ForCausalLM``          q/k norms, sliding window on layer 1, untied head
    ``Phi3ForCausalLM``           longrope (original context 16), partial rotary 0.75
    ``Gemma2ForCausalLM``         attention and final-logit soft-caps, sliding layer 0
    ``Gemma3ForCausalLM``         q/k norms, local base 10 000 / global base 1e6 with linear x2
    ``Qwen3MoeForCausalLM``       3 layers: 8 experts of 48, top-2 not renormalised, layer 1 dense
                                  (``mlp_only_layers``); q/k norms, untied head
    ``MixtralForCausalLM``        8 experts of 96, top-2 renormalised, sliding window on every layer
    ============================  ===========================================================
    """
    import transformers

    shapes = dict(TINY_SHAPES, vocab_size=vocab_size, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    shapes.update(_special_token_ids(tokenizer_dir))
    window = dict(use_sliding_window=True, sliding_window=TINY_SLIDING_WINDOW, max_window_layers=1)
    rotary = int(TINY_SHAPES["head_dim"] * 0.75)
    gemma = dict(query_pre_attn_scalar=16, sliding_window=TINY_SLIDING_WINDOW, tie_word_embeddings=True)
    by_arch = {
        "LlamaForCausalLM": ("LlamaConfig", dict(tie_word_embeddings=True)),
        "MistralForCausalLM": ("MistralConfig", dict(sliding_window=TINY_SLIDING_WINDOW, tie_word_embeddings=False)),
        "Qwen2ForCausalLM": ("Qwen2Config", dict(window, tie_word_embeddings=True)),
        "Qwen3ForCausalLM": ("Qwen3Config", dict(window, tie_word_embeddings=False)),
        "Phi3ForCausalLM": ("Phi3Config", dict(
            tie_word_embeddings=False, max_position_embeddings=128, original_max_position_embeddings=16,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                             "short_factor": [1.0 + 0.1 * i for i in range(rotary // 2)],
                             "long_factor": [2.0 + 0.5 * i for i in range(rotary // 2)],
                             "original_max_position_embeddings": 16})),
        "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(
            num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False)),
        "MixtralForCausalLM": ("MixtralConfig", dict(
            num_local_experts=8, num_experts_per_tok=2, sliding_window=TINY_SLIDING_WINDOW, tie_word_embeddings=False)),
        "Gemma2ForCausalLM": ("Gemma2Config", dict(gemma, attn_logit_softcapping=5.0, final_logit_softcapping=8.0)),
        "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(
            gemma, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}})),
    }
    if architecture not in by_arch:
        raise ValueError(f"no tiny config for {architecture!r}; known: {sorted(by_arch)}")
    cls_name, extra = by_arch[architecture]
    kwargs = dict(shapes, **extra)
    kwargs.update(overrides)
    return getattr(transformers, cls_name)(**kwargs)
