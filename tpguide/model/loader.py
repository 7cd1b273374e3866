"""Load a local Hugging Face directory into one rank's model shard.

Each checkpoint tensor is opened lazily with
``safetensors.safe_open(...).get_slice(name)`` and handed to the target
parameter's ``weight_loader``, which reads only this rank's rows or columns.
HF names map onto the TP modules like this (``N`` = layer)::

    model.layers.N.self_attn.{q,k,v}_proj.*  ->  model.layers.N.self_attn.qkv_proj.*   shard "q"/"k"/"v"
    model.layers.N.mlp.{gate,up}_proj.*      ->  model.layers.N.mlp.gate_up_proj.*     shard 0 / 1
    everything else                          ->  the parameter of the same name
    lm_head.weight                           ->  skipped when tie_word_embeddings
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from tpguide.dist import TPGroup
from tpguide.model.config import ModelConfig
from tpguide.model.llama import LlamaForCausalLM

#: ``(HF substring, TP substring, shard_id)`` for packed parameters.
PACKED_MODULES = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
#: Checkpoint tensors that are not parameters (recomputed buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def map_checkpoint_name(name: str) -> Tuple[str, Any]:
    """HF tensor name -> ``(parameter name, shard_id)``; ``shard_id`` is None if unpacked."""
    for hf, tp, shard_id in PACKED_MODULES:
        if hf in name:
            return name.replace(hf, tp), shard_id
    return name, None


def expected_checkpoint_names(config: ModelConfig) -> set[str]:
    """The HF tensor names a checkpoint of ``config`` must contain."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    per_layer += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    if config.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if config.o_proj_bias:
        per_layer.append("self_attn.o_proj.bias")
    if config.mlp_bias:
        per_layer += [f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")]
    for i in range(config.num_hidden_layers):
        names.update(f"model.layers.{i}.{p}" for p in per_layer)
    return names


def load_weights(model: LlamaForCausalLM, model_dir: str | Path) -> None:
    """Fill ``model``'s parameters from ``model_dir/*.safetensors``, this rank's slices only.

    Raises
    ------
    ValueError
        No safetensors files; a tensor whose shape does not match the config
        (names the tensor and both shapes); missing or unexpected tensors.
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in model directory {str(model_dir)!r}")
    params: Dict[str, torch.nn.Parameter] = dict(model.named_parameters())
    expected = expected_checkpoint_names(model.config)
    seen: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue  # some tied checkpoints store the shared matrix twice
                param_name, shard_id = map_checkpoint_name(name)
                if name not in expected or param_name not in params:
                    raise ValueError(f"unexpected tensor {name!r} in {path.name} for this model config")
                param = params[param_name]
                try:
                    param.weight_loader(param, f.get_slice(name), shard_id)
                except ValueError as exc:
                    raise ValueError(f"tensor {name!r} in {path.name}: {exc}") from exc
                seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint in {str(model_dir)!r} lacks {len(missing)} tensors: {shown}")


def load_model(model_dir: str | Path, group: TPGroup, dtype: torch.dtype = torch.float32,
               tokenizer_vocab_size: Optional[int] = None, tp_invariant: bool = True) -> LlamaForCausalLM:
    """Build this rank's :class:`LlamaForCausalLM` from a local HF directory and load its weights.

    Parameters
    ----------
    model_dir : str or Path
        Holds ``config.json`` and ``*.safetensors``.
    group : TPGroup
        This rank's group; each rank reads only its slices.
    dtype : torch.dtype
        Parameter dtype (checkpoint tensors are cast).
    tokenizer_vocab_size : int, optional
        Ids at or above it get ``-inf`` logits.
    tp_invariant : bool
        TP-invariant row-parallel reductions (see :class:`LlamaForCausalLM`).

    Raises
    ------
    ValueError
        Missing directory, ``config.json`` or safetensors; unsupported config or
        ``tp_size``; checkpoint tensors that do not match the config.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model directory {str(model_dir)!r} does not exist")
    if not any(model_dir.glob("*.safetensors")):
        raise ValueError(f"no *.safetensors files in model directory {str(model_dir)!r}")
    config = ModelConfig.from_pretrained(model_dir)
    model = LlamaForCausalLM(config, group, dtype, tokenizer_vocab_size=tokenizer_vocab_size, tp_invariant=tp_invariant)
    load_weights(model, model_dir)
    return model.eval()
