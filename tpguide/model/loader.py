"""Load a local Hugging Face directory into one rank's model shard.

Each checkpoint tensor is opened lazily (:mod:`tpguide.model.safetensors_reader`:
plain reads, no memory map; a sharded checkpoint's files are those its
``model.safetensors.index.json`` names) and handed to the target parameter's
``weight_loader``, which reads only this rank's rows or columns, at the
checkpoint's dtype, straight into the parameter (bf16 into bf16: no fp32
copy).  HF names map onto the TP modules like this (``N`` = layer)::

    model.layers.N.self_attn.{q,k,v}_proj.*  ->  model.layers.N.self_attn.qkv_proj.*   shard "q"/"k"/"v"
    model.layers.N.mlp.{gate,up}_proj.*      ->  model.layers.N.mlp.gate_up_proj.*     shard 0 / 1
    model.layers.N.self_attn.qkv_proj.*      ->  (Phi-3, fused) row views "q", "k", "v" of the same
    model.layers.N.mlp.gate_up_proj.*        ->  (Phi-3, fused) row views 0, 1 of the same
    model.layers.N.mlp.experts.*, .gate.*    ->  (MoE layers) see tpguide.model.moe_checkpoint
    model.layers.N.block_sparse_moe.*        ->  (Mixtral) the same parameters
    everything else                          ->  the parameter of the same name
    lm_head.weight                           ->  skipped when tie_word_embeddings

The architecture picks the model class (:data:`MODEL_CLASSES`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from tpguide.dist import TPGroup
from tpguide.model.config import ModelConfig
from tpguide.model.gemma2 import Gemma2ForCausalLM
from tpguide.model.gemma3 import Gemma3ForCausalLM, text_weight_name
from tpguide.model.invariant_reduce import drop_packed_weights
from tpguide.model.llama import LlamaForCausalLM
from tpguide.model.mixtral import MixtralForCausalLM
from tpguide.model.moe_checkpoint import expert_checkpoint_names, expert_targets
from tpguide.model.phi3 import Phi3ForCausalLM, fused_parts
from tpguide.model.qwen3 import Qwen3ForCausalLM
from tpguide.model.qwen3_moe import Qwen3MoeForCausalLM
from tpguide.model.safetensors_reader import checkpoint_files, iter_checkpoint
from tpguide.model.weight_slice import RowView, loaded_shape

#: HF architecture -> this package's model class.
MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM, "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM, "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM, "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}

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
    if config.architecture == "Phi3ForCausalLM":
        per_layer += ["self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                      "mlp.down_proj.weight"]
    else:
        per_layer += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    if config.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if config.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    if config.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if config.o_proj_bias:
        per_layer.append("self_attn.o_proj.bias")
    if config.mlp_bias:
        per_layer += [f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")]
    for i in range(config.num_hidden_layers):
        names.update(f"model.layers.{i}.{p}" for p in per_layer)
        if config.is_moe_layer(i):
            names.update(expert_checkpoint_names(config, i))
        elif config.architecture != "Phi3ForCausalLM":
            names.update(f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
    return names


def load_weights(model: LlamaForCausalLM, model_dir: str | Path) -> None:
    """Fill ``model``'s parameters from the checkpoint in ``model_dir``, this rank's slices only.

    Raises
    ------
    ValueError
        No safetensors files; a tensor whose shape does not match the config
        (names the tensor and both shapes); missing or unexpected tensors.
    """
    params: Dict[str, torch.nn.Parameter] = dict(model.named_parameters())
    config = model.config
    expected = expected_checkpoint_names(config)
    seen: set[str] = set()
    for file_name, name, loaded in iter_checkpoint(model_dir):
        if config.text_decoder_of is not None:  # a multimodal checkpoint: its language model only
            name = text_weight_name(name)
            if name is None:
                continue
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some tied checkpoints store the shared matrix twice
        parts = fused_parts(name, config) if config.architecture == "Phi3ForCausalLM" else []
        try:
            experts = expert_targets(name, loaded, config) if config.num_experts else None
        except ValueError as exc:
            raise ValueError(f"tensor {name!r} in {file_name}: {exc}") from exc
        if experts is not None:  # (covered name, parameter, shard_id, part): a fused tensor covers many
            targets = experts
        elif parts:
            targets = [(name, name, shard_id, RowView(loaded, start, rows)) for shard_id, start, rows in parts]
        else:
            targets = [(name, *map_checkpoint_name(name), loaded)]
        for covered, param_name, shard_id, part in targets:
            if covered not in expected or param_name not in params:
                raise ValueError(f"unexpected tensor {name!r} in {file_name} for this model config")
            param = params[param_name]
            try:
                if parts and loaded_shape(loaded)[0] != sum(rows for _, _, rows in parts):
                    raise ValueError(f"fused checkpoint tensor has shape {list(loaded_shape(loaded))}, the config "
                                     f"expects {sum(rows for _, _, rows in parts)} rows")
                param.weight_loader(param, part, shard_id)
            except ValueError as exc:
                raise ValueError(f"tensor {name!r} in {file_name}: {exc}") from exc
            seen.add(covered)
    missing = sorted(expected - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint in {str(model_dir)!r} lacks {len(missing)} tensors: {shown}")
    drop_packed_weights(model)  # the fixed-order kernels repack from the loaded weights


def load_model(model_dir: str | Path, group: TPGroup, dtype: torch.dtype = torch.float32,
               tokenizer_vocab_size: Optional[int] = None, tp_invariant: bool = True) -> LlamaForCausalLM:
    """Build this rank's model (the class of its architecture) from a local HF directory and load its weights.

    Parameters
    ----------
    model_dir : str or Path
        Holds ``config.json`` and ``*.safetensors``.
    group : TPGroup
        This rank's group; each rank reads only its slices.
    dtype : torch.dtype
        Parameter dtype (checkpoint tensors are cast slice by slice; at the
        checkpoint's own dtype nothing is converted,
        see :func:`tpguide.model.safetensors_reader.checkpoint_dtype`).
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
    checkpoint_files(model_dir)  # raises if there are none
    config = ModelConfig.from_pretrained(model_dir)
    model = MODEL_CLASSES[config.architecture](config, group, dtype, tokenizer_vocab_size=tokenizer_vocab_size,
                                                 tp_invariant=tp_invariant)
    load_weights(model, model_dir)
    return model.eval()
