"""Write a random-weight Llama checkpoint of a real size (default ~1.07 B parameters) for the memory and speed benchmarks.

The default shape is Llama 3.2 1B's (hidden 2048, 16 layers, 32 query heads,
8 KV heads, MLP 8192, tied embeddings) with the embedded SmolLM2 tokenizer
(49,152 ids), so the directory runs the fixture requests with the chat
template tpguide ships.  Tensors are written in bf16 straight to
``--shards`` safetensors files with a ``model.safetensors.index.json``, as
``save_pretrained`` writes a sharded checkpoint, without building a
transformers model (no fp32 copy of the whole model in memory: one tensor at
a time).  Weights are normal with std ``--std`` (0.02, transformers'
``initializer_range``), norm weights ``1 + 0.1 * normal``.

Never committed: the directory must lie outside the repository (``/tmp`` by
default).  Same arguments, same bytes.

Usage::

    python benchmarks/make_random_checkpoint.py [--out /tmp/tpguide-llama-1b] [--hidden-size 2048]
        [--num-layers 16] [--num-heads 32] [--num-kv-heads 8] [--intermediate-size 8192] [--shards 3]
        [--untied] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_OUT = Path("/tmp/tpguide-llama-1b")


def tensor_shapes(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                  tied: bool) -> List[Tuple[str, Tuple[int, ...]]]:
    """``(HF name, shape)`` of every tensor of a Llama checkpoint, in ``save_pretrained``'s order."""
    head_dim = hidden // heads
    shapes: List[Tuple[str, Tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (hidden,)),
                   (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
                   (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
                   (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
                   (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
                   (p + "post_attention_layernorm.weight", (hidden,)),
                   (p + "mlp.gate_proj.weight", (intermediate, hidden)),
                   (p + "mlp.up_proj.weight", (intermediate, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, intermediate))]
    shapes.append(("model.norm.weight", (hidden,)))
    if not tied:
        shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


def split_shards(shapes: List[Tuple[str, Tuple[int, ...]]], num_shards: int) -> List[List[Tuple[str, Tuple[int, ...]]]]:
    """Consecutive groups of tensors with about equal bytes (at least one tensor each)."""
    sizes = [torch.Size(s).numel() for _, s in shapes]
    total, shards, current, acc = sum(sizes), [], [], 0
    for (name, shape), n in zip(shapes, sizes):
        current.append((name, shape))
        acc += n
        if acc >= total * (len(shards) + 1) / num_shards and len(shards) < num_shards - 1:
            shards.append(current)
            current = []
    shards.append(current)
    return [s for s in shards if s]


def write_checkpoint(out: Path, *, hidden: int = 2048, layers: int = 16, heads: int = 32, kv_heads: int = 8,
                     intermediate: int = 8192, shards: int = 3, tied: bool = True, std: float = 0.02,
                     seed: int = 0) -> Dict[str, int]:
    """Write the checkpoint to ``out``; returns ``{"parameters": ..., "bytes": ...}`` (a tied head counted once).

    Raises
    ------
    ValueError
        ``out`` inside the repository, or a shape transformers' Llama rejects
        (``hidden % heads``, ``heads % kv_heads``).
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from tpguide.model.default_model import default_model_dir
    from tpguide.model.random_checkpoint import TOKENIZER_FILES

    out = out.expanduser().absolute()
    if out == REPO or REPO in out.parents:
        raise ValueError(f"--out {out} is inside the repository {REPO}: write random checkpoints under /tmp")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden_size={hidden} must divide by num_heads={heads}, and num_heads by "
                         f"num_kv_heads={kv_heads}")
    tokenizer_dir = default_model_dir()
    src = json.loads((tokenizer_dir / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=src["vocab_size"], hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=hidden // heads, max_position_embeddings=8192, tie_word_embeddings=tied,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                         initializer_range=std, torch_dtype="bfloat16",
                         **{k: src[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in src})
    config.architectures = ["LlamaForCausalLM"]
    config.to_json_file(out / "config.json")
    for fname in TOKENIZER_FILES:
        if (tokenizer_dir / fname).is_file() and fname != "config.json":
            shutil.copyfile(tokenizer_dir / fname, out / fname)
    shapes = tensor_shapes(hidden, layers, heads, kv_heads, intermediate, src["vocab_size"], tied)
    groups = split_shards(shapes, shards)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        file_name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name, shape in group:
            if name.endswith("norm.weight"):
                t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            else:
                t = torch.randn(shape, generator=gen).mul_(std)
            tensors[name] = t.to(torch.bfloat16)
            weight_map[name] = file_name
            total += tensors[name].numel()
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total * 2}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {"parameters": total, "bytes": total * 2}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"directory outside the repo (default {DEFAULT_OUT})")
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--num-layers", type=int, default=16)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--intermediate-size", type=int, default=8192)
    p.add_argument("--shards", type=int, default=3, help="safetensors files (default 3)")
    p.add_argument("--untied", action="store_true", help="a separate lm_head.weight (default: tied embeddings)")
    p.add_argument("--std", type=float, default=0.02, help="std of the random weights (default 0.02)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    facts = write_checkpoint(a.out, hidden=a.hidden_size, layers=a.num_layers, heads=a.num_heads,
                             kv_heads=a.num_kv_heads, intermediate=a.intermediate_size, shards=a.shards,
                             tied=not a.untied, std=a.std, seed=a.seed)
    print(f"{a.out}: {facts['parameters'] / 1e9:.3f} B parameters, {facts['bytes'] / 2**30:.2f} GiB bf16 "
          f"in {a.shards} safetensors files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
