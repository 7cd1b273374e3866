"""Tiny random-weight Llama checkpoints for tests and benchmarks.

:func:`write_random_checkpoint` builds transformers' own ``LlamaForCausalLM``
with random weights and ``save_pretrained``-s it, so the directory is a real
HF checkpoint (``config.json``, ``model.safetensors``) that transformers and
tpguide both load.  Default shape mimics SmolLM2's head layout (9 query heads,
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
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    special = {}
    if tokenizer_dir is not None:
        src_config = Path(tokenizer_dir) / "config.json"
        if src_config.is_file():
            src = json.loads(src_config.read_text())
            special = {k: src[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in src}
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
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    if tokenizer_dir is not None:
        for fname in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / fname
            if src.is_file():
                shutil.copyfile(src, out_dir / fname)
    return out_dir
