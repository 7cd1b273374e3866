"""Checkpoint names of the mixture-of-experts layers, in the layouts Hugging Face checkpoints use.

Every layout lands in the same parameters of :class:`~tpguide.model.moe.SparseMoeBlock`
(``model.layers.L.mlp.gate.weight``, ``mlp.experts.N.gate_up_proj.weight``
packed ``[gate; up]``, ``mlp.experts.N.down_proj.weight``); each expert is
sharded by its layer's own ``weight_loader`` (gate/up rows, down columns)::

    per expert (hub checkpoints; what save_pretrained of transformers 5 writes)
      Qwen3-MoE  model.layers.L.mlp.experts.N.gate_proj.weight            [I, H]  -> gate_up_proj shard 0
                 model.layers.L.mlp.experts.N.up_proj.weight              [I, H]  -> gate_up_proj shard 1
                 model.layers.L.mlp.experts.N.down_proj.weight            [H, I]  -> down_proj
                 model.layers.L.mlp.gate.weight                           [E, H]  -> mlp.gate.weight
      Mixtral    model.layers.L.block_sparse_moe.experts.N.w1/w3/w2.weight        -> gate / up / down as above
                 model.layers.L.block_sparse_moe.gate.weight                      -> mlp.gate.weight
    fused (transformers 5's in-memory experts, as a state_dict saved without its conversion)
                 model.layers.L.mlp.experts.gate_up_proj                  [E, 2I, H]  -> each expert's [gate; up] rows
                 model.layers.L.mlp.experts.down_proj                     [E, H, I]   -> each expert's down_proj

A fused tensor is read lazily too: expert ``N``'s rows are a view
(:func:`expert_rows`) and each rank reads only its own rows.
"""

from __future__ import annotations

import copy
import re
from typing import Any, List, Optional, Tuple

import torch

from tpguide.model.config import ModelConfig
from tpguide.model.safetensors_reader import TensorSlice
from tpguide.model.weight_slice import Loadable, RowView, loaded_shape

#: Mixtral's expert tensor names -> Qwen3-MoE's.
MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")
_GATE = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight$")

#: ``(covered checkpoint name, parameter name, shard_id, loadable)``.
Target = Tuple[str, str, Any, Loadable]


class ExpertView:
    """Expert ``expert`` (index on dim 0) of a fused ``[E, ...]`` :data:`Loadable`, itself lazily sliceable."""

    def __init__(self, loaded: Loadable, expert: int) -> None:
        shape = loaded_shape(loaded)
        if not 0 <= expert < shape[0]:
            raise ValueError(f"expert {expert} outside a fused expert tensor of shape {list(shape)}")
        self.loaded, self.expert, self.shape = loaded, expert, tuple(shape[1:])

    def get_shape(self) -> list:
        return list(self.shape)

    def __getitem__(self, index: Tuple[slice, ...]) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (len(self.shape) - len(index))
        return self.loaded[(slice(self.expert, self.expert + 1), *index)][0]


def expert_rows(loaded: Loadable, expert: int) -> Loadable:
    """Expert ``expert`` of a fused ``[E, R, C]`` tensor as a lazily sliceable ``[R, C]``.

    A tensor or a :class:`~tpguide.model.safetensors_reader.TensorSlice` is
    seen as ``[E * R, C]`` rows, of which the expert's are a
    :class:`~tpguide.model.weight_slice.RowView`, so a rank reads only the
    rows it keeps; any other lazy slice goes through :class:`ExpertView`.
    """
    shape = loaded_shape(loaded)
    flat_shape = (shape[0] * shape[1], *shape[2:])
    if isinstance(loaded, torch.Tensor):
        flat = loaded.reshape(flat_shape)
    elif isinstance(loaded, TensorSlice):
        flat = copy.copy(loaded)
        flat.shape = flat_shape  # the same bytes, row-major: expert e's rows are rows [e * R, (e + 1) * R)
    else:
        return ExpertView(loaded, expert)
    return RowView(flat, expert * shape[1], shape[1])


def _family_name(config: ModelConfig, layer: str, expert: int, proj: str) -> str:
    """The per-expert checkpoint name of ``proj`` (Qwen3-MoE spelling in) as the family spells it."""
    if config.architecture == "MixtralForCausalLM":
        w = {v: k for k, v in MIXTRAL_NAMES.items()}[proj]
        return f"{layer}.block_sparse_moe.experts.{expert}.{w}.weight"
    return f"{layer}.mlp.experts.{expert}.{proj}.weight"


def expert_checkpoint_names(config: ModelConfig, layer_idx: int) -> List[str]:
    """The per-expert layout's names of MoE layer ``layer_idx`` (gate and every expert), as the family spells them."""
    layer = f"model.layers.{layer_idx}"
    gate = "block_sparse_moe" if config.architecture == "MixtralForCausalLM" else "mlp"
    return [f"{layer}.{gate}.gate.weight"] + [_family_name(config, layer, e, p) for e in range(config.num_experts)
                                               for p in ("gate_proj", "up_proj", "down_proj")]


def expert_targets(name: str, loaded: Loadable, config: ModelConfig) -> Optional[List[Target]]:
    """Where checkpoint tensor ``name`` goes, if it belongs to a MoE block; None otherwise.

    Each target names the per-expert checkpoint name it stands for (a fused
    tensor stands for all its experts'), so the loader's completeness check
    works in one set of names.

    Raises
    ------
    ValueError
        A fused tensor whose expert count or row count does not match the config.
    """
    m = _PER_EXPERT.match(name)
    if m:
        layer, expert, proj = m.group(1), int(m.group(2)), MIXTRAL_NAMES.get(m.group(3), m.group(3))
        param = f"{layer}.mlp.experts.{expert}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}.weight"
        shard_id = {"gate_proj": 0, "up_proj": 1}.get(proj)
        return [(_family_name(config, layer, expert, proj), param, shard_id, loaded)]
    m = _GATE.match(name)
    if m:
        gate = "block_sparse_moe" if config.architecture == "MixtralForCausalLM" else "mlp"
        return [(f"{m.group(1)}.{gate}.gate.weight", f"{m.group(1)}.mlp.gate.weight", None, loaded)]
    m = _FUSED.match(name)
    if not m:
        return None
    layer, kind = m.group(1), m.group(2)
    shape, i = loaded_shape(loaded), config.moe_intermediate_size
    rows = 2 * i if kind == "gate_up_proj" else config.hidden_size
    if len(shape) != 3 or shape[0] != config.num_experts or shape[1] != rows:
        raise ValueError(f"fused expert tensor {name!r} has shape {list(shape)}, the config expects "
                         f"[{config.num_experts}, {rows}, ...]")
    targets: List[Target] = []
    for e in range(config.num_experts):
        view = expert_rows(loaded, e)
        if kind == "down_proj":
            targets.append((_family_name(config, layer, e, "down_proj"), f"{layer}.mlp.experts.{e}.down_proj.weight",
                            None, view))
            continue
        for shard_id, proj in enumerate(("gate_proj", "up_proj")):  # rows [gate | up], transformers' chunk(2)
            targets.append((_family_name(config, layer, e, proj), f"{layer}.mlp.experts.{e}.gate_up_proj.weight",
                            shard_id, RowView(view, shard_id * i, i)))
    return targets
