"""Each linear weight held once: the packed copy replaces the checkpoint layout (docs/architecture.md §6).

The fixed-order CPU kernels read a weight packed into panels
(:func:`tpguide.kernels.fixed_order_cpu.pack_weight`).  Once a layer's
weight is packed at start-up (:func:`tpguide.model.invariant_reduce.prepack_weights`),
:func:`hold_packed_only` frees the checkpoint-layout tensor: the parameter
becomes a :class:`ReleasedWeight`, a tensor of the same shape, dtype, strides
and device without storage, whose ``packed`` attribute is the
:class:`PackedWeight`, so a rank's resident weights are its shard's bytes,
not twice them.  The LM head is packed into its own storage
(:func:`pack_in_place`), so its packed copy is never held beside it.  Every module that shares the parameter (the tied embedding
and LM head) gets the placeholder.

Who reads a released weight, and how:

* the fixed-order linears: :func:`~tpguide.model.invariant_reduce.packed_weight`
  returns ``weight.packed``;
* the tied embedding's row lookup: :func:`embedding_rows` copies the rows out
  of the packed panels (the same bits as ``F.embedding`` on the checkpoint
  layout);
* any other operation on it (``F.linear``, ``F.embedding``, ``.to()``,
  arithmetic) raises ``RuntimeError`` naming the operation: nothing reads
  numbers that are not there (a ``meta`` tensor would not do: ``F.linear``
  of a CPU input and a ``meta`` weight returns uninitialised CPU memory);
  loading into a released parameter raises (build a new model to reload).

The plain mode (``--no-tp-invariant``) and CUDA pack nothing, so nothing is
released there.  The draft head reads its rows from the checkpoint file.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from tpguide.kernels.fixed_order_cpu import PACK_CHUNK_ROWS, PANEL, PackedWeight, pack_weight


class ReleasedWeight(torch.Tensor):
    """A weight's shape, dtype, strides and device without storage; its values are ``self.packed``'s.

    Every aten operation but ``detach`` / ``alias`` (which ``nn.Parameter``
    uses) raises ``RuntimeError`` naming it.
    """

    packed: PackedWeight

    @staticmethod
    def __new__(cls, like: torch.Tensor, packed: PackedWeight) -> "ReleasedWeight":
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype,
                                                device=like.device, requires_grad=False)
        t.packed = packed
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return ReleasedWeight(args[0], args[0].packed)
        raise RuntimeError(f"{func} on a weight {list(args[0].shape) if args else ''} held only packed "
                           "(tpguide.model.held_weights): read it through packed_rows / unpack_weight")

    def __repr__(self) -> str:
        return f"ReleasedWeight(shape={list(self.shape)}, dtype={self.dtype}, held packed)"


def is_released(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a placeholder whose values live only in ``weight.packed``."""
    return isinstance(weight, ReleasedWeight)


def _refuse_load(param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
    raise ValueError(f"this weight {list(param.shape)} was released after packing (the packed copy is the only "
                     "one): load checkpoints into a new model")


def parameter_users(root: nn.Module) -> Dict[int, List[Tuple[nn.Module, str]]]:
    """``id(parameter) -> [(module, attribute name), ...]``: every module holding each parameter (tied ones twice)."""
    users: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for name, p in module._parameters.items():
            if p is not None:
                users.setdefault(id(p), []).append((module, name))
    return users


def hold_packed_only(weight: nn.Parameter, packed: PackedWeight,
                     users: Dict[int, List[Tuple[nn.Module, str]]]) -> nn.Parameter:
    """Replace ``weight`` by a data-less placeholder carrying ``packed`` in every module of ``users``; returns it.

    ``weight``'s storage is freed once nothing else refers to it.  The
    placeholder (a :class:`ReleasedWeight` parameter) keeps ``shape``,
    ``dtype``, strides and device; ``placeholder.packed`` is ``packed``.  An
    already released weight is returned unchanged.
    """
    if is_released(weight):
        return weight
    held = nn.Parameter(ReleasedWeight(weight, packed), requires_grad=False)
    held.weight_loader = _refuse_load
    for module, name in users.pop(id(weight), []):
        setattr(module, name, held)
    return held


def pack_in_place(weight: nn.Parameter) -> Optional[PackedWeight]:
    """Pack ``weight [N, K]`` (one unit) into its own storage, :data:`PACK_CHUNK_ROWS` rows at a time; None
    (nothing written) where the packed panels would not fit that storage exactly.

    A one-unit layout with ``N % PANEL == 0`` and no ``k`` padding puts
    panel ``p`` on the bytes of rows ``p*PANEL .. (p+1)*PANEL``, so each chunk
    is packed (:func:`~tpguide.kernels.fixed_order_cpu.pack_weight`, the same
    bits as packing the whole weight: panels never mix) and written over its
    own rows, and the packed copy never sits beside the checkpoint layout:
    the start-up's peak is one chunk above the weight, not the weight twice
    (the ~1 B benchmark's tied LM head: 192 MiB at tp 1).  The checkpoint
    layout is gone afterwards: the caller must release ``weight``
    (:func:`hold_packed_only`).  Needs a contiguous weight owning its whole
    storage (CPU, fp32 or bf16), else None.
    """
    w = weight.detach()
    if w.dim() != 2 or not w.is_contiguous() or w.storage_offset() != 0 \
            or w.untyped_storage().nbytes() != w.numel() * w.element_size() or w.shape[0] % PANEL:
        return None
    n, k = w.shape
    rows = max(PANEL, PACK_CHUNK_ROWS // PANEL * PANEL)
    first = pack_weight(w[:rows])
    if first.padded_unit_size != k:  # k padded to the tile (AMX): the panels outgrow the storage
        return None
    flat = w.view(-1)
    for r0 in range(0, n, rows):
        part = first if r0 == 0 else pack_weight(w[r0:r0 + rows])
        flat[r0 * k:(r0 + part.out_features) * k].copy_(part.panels.reshape(-1))
    panels = flat.view(1, n // PANEL, *first.panels.shape[2:])
    return PackedWeight(panels, n, k, 1, (w.data_ptr(), w._version), k, first.isa)


def packed_rows(packed: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the weight ``packed`` was made from: ``[T, K]`` in its dtype, the same bits.

    ``ids`` int64 ``[T]`` in ``[0, out_features)``; ``packed`` one unit
    (``num_units == 1``: the LM head).  The panels hold
    ``w[p*PANEL + j, k]`` at ``[0, p, k, j]`` (pairs: ``[0, p, k // 2, j, k % 2]``).

    Raises
    ------
    ValueError
        ``packed`` has several units.
    IndexError
        An id outside ``[0, out_features)`` (as ``F.embedding``).
    """
    if packed.num_units != 1:
        raise ValueError(f"row lookup needs a weight packed in one unit, got num_units={packed.num_units}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= packed.out_features):
        raise IndexError(f"ids in [{int(ids.min())}, {int(ids.max())}] outside [0, {packed.out_features})")
    p, j = ids // PANEL, ids % PANEL
    panels = packed.panels[0]
    if panels.dim() == 4:  # [P, K_pad / 2, PANEL, 2]: k pairs
        rows = panels[p, :, j, :]  # [T, K_pad / 2, 2]
        return rows.reshape(ids.numel(), -1)[:, :packed.unit_size].contiguous()
    return panels[p, :, j]  # [T, K]


def embedding_rows(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)``, from the packed copy when the weight was released (``[T, dim]``)."""
    if is_released(weight):
        return packed_rows(weight.packed, ids)
    return F.embedding(ids, weight)


def unpack_weight(packed: PackedWeight) -> torch.Tensor:
    """The ``[N, U * K_unit]`` checkpoint-layout weight ``packed`` was made from (a new tensor, the same bits)."""
    panels = packed.panels
    if panels.dim() == 5:  # [U, P, K_pad / 2, PANEL, 2] -> [U, P, K_pad, PANEL]
        panels = panels.permute(0, 1, 3, 2, 4).flatten(3).transpose(2, 3)
    n, unit = packed.out_features, packed.unit_size
    full = panels[:, :, :unit, :].permute(1, 3, 0, 2).flatten(0, 1)  # [P * PANEL, U, K_unit]
    return full[:n].reshape(n, packed.num_units * unit).contiguous()


def resident_weight_bytes(module: nn.Module) -> int:
    """Bytes of the distinct storages behind ``module``'s parameters and packed weights (each counted once)."""
    seen: Dict[int, int] = {}
    for m in module.modules():
        params = [p for p in m._parameters.values() if p is not None]
        tensors = [p.packed.panels if is_released(p) else p for p in params]
        cached = getattr(m, "_packed_weight", None)
        if cached is not None:
            tensors.append(cached.panels)
        for t in tensors:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
