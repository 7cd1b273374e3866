"""A tiny random-weight Qwen3 reasoning checkpoint: the embedded tokenizer plus ``<think>``/``</think>``, Qwen3's template.

docs/reasoning.md.  No reasoning checkpoint can be downloaded here, so the
tests and ``benchmarks/reasoning_demo.py`` build one: the random-weight
Qwen3 of :func:`~tpguide.model.random_checkpoint.tiny_hf_config`, whose
tokenizer is the embedded SmolLM2's with ``<think>`` and ``</think>`` added
as special tokens (ids 49152 and 49153), and whose chat template follows
Qwen3's handling of ``enable_thinking`` (False: an empty think block closes
the prompt, so the answer starts at the first output token).  A random model
thinks in noise, so its runs are checked with ``thinking_token_budget``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

#: Qwen3's chat template, reduced to what tpguide's requests use (roles, the generation prompt, enable_thinking).
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def write_tiny_reasoning_model(out_dir: str | Path, tokenizer_dir: Optional[str | Path] = None, *,
                               seed: int = 0) -> Path:
    """Write the tiny reasoning checkpoint to ``out_dir`` (created) and return it.

    Parameters
    ----------
    out_dir : str or Path
    tokenizer_dir : str or Path, optional
        The embedded model's directory (default: converted once, :func:`default_model_dir`).
    seed : int
        Of the random weights.
    """
    from transformers import AutoTokenizer

    from tpguide.model.default_model import default_model_dir
    from tpguide.model.random_checkpoint import tiny_hf_config, write_random_model

    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    out_dir = Path(out_dir)
    config = tiny_hf_config("Qwen3ForCausalLM", len(tokenizer), tokenizer_dir=tokenizer_dir, max_position_embeddings=512)
    write_random_model(out_dir, config,
                       seed=seed)
    tokenizer.save_pretrained(out_dir)
    generation_config = tokenizer_dir / "generation_config.json"
    if generation_config.is_file():
        (out_dir / "generation_config.json").write_text(generation_config.read_text())
    return out_dir
