"""Reading one shard of a checkpoint tensor, lazily.

Every ``weight_loader`` in :mod:`tpguide.model` accepts either a full
``torch.Tensor`` or a lazily sliceable safetensors object (what
``safe_open(...).get_slice(name)`` returns: ``get_shape()`` and
``__getitem__`` with a tuple of slices).  With the latter only the rank's
rows are read from disk.
"""

from __future__ import annotations

from typing import Any, Sequence, Tuple, Union

import torch

#: A full tensor or a safetensors ``PySafeSlice``.
Loadable = Union[torch.Tensor, Any]


def loaded_shape(loaded: Loadable) -> Tuple[int, ...]:
    """Shape of the whole checkpoint tensor, without reading it."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())  # safetensors slice, TensorSlice or RowView


def check_shape(loaded: Loadable, expected: Sequence[int]) -> None:
    """Raise ``ValueError`` naming both shapes if the checkpoint tensor has the wrong shape."""
    actual = loaded_shape(loaded)
    if actual != tuple(expected):
        raise ValueError(f"checkpoint tensor has shape {list(actual)}, the config expects {list(expected)}")


def read_rows(loaded: Loadable, dim: int, start: int, length: int) -> torch.Tensor:
    """``loaded`` narrowed to ``[start, start + length)`` along ``dim`` (reads only that slice)."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = tuple(slice(start, start + length) if d == dim else slice(None) for d in range(len(loaded_shape(loaded))))
    return loaded[index]


#: Bytes of checkpoint data read per block by :func:`copy_clipped_` (bounds the transient memory of a load).
COPY_BLOCK_BYTES = 4 << 20


def copy_clipped_(dst: torch.Tensor, loaded: Loadable, dim: int, start: int) -> torch.Tensor:
    """Copy ``loaded[start : start + dst.size(dim)]`` (along ``dim``) into ``dst``, in place.

    Rows past the end of the checkpoint tensor (zero-padded heads, padded
    vocabulary) are set to zero.  Whole rows of a
    :class:`~tpguide.model.safetensors_reader.TensorSlice` at ``dst``'s dtype
    are read straight into ``dst``; other lazy slices in blocks of
    :data:`COPY_BLOCK_BYTES` along dim 0, so a load holds at most one block
    besides the parameters.  Returns ``dst``.
    """
    total = loaded_shape(loaded)[dim]
    n = max(0, min(dst.size(dim), total - start))
    if n < dst.size(dim):
        dst.zero_()
    if n <= 0:
        return dst
    target = dst.narrow(dim, 0, n)
    if (dim == 0 and hasattr(loaded, "read_rows_into") and target.is_contiguous()
            and target.dtype == loaded.get_dtype()):
        loaded.read_rows_into(target, start)  # whole rows at the checkpoint's dtype: straight from the file
        return dst
    if isinstance(loaded, torch.Tensor) or target.dim() == 0:
        target.copy_(read_rows(loaded, dim, start, n))
        return dst
    rows_per_block = max(1, COPY_BLOCK_BYTES // max(1, target[0].numel() * target.element_size()))
    row_start = start if dim == 0 else 0
    for lo in range(0, target.size(0), rows_per_block):
        b = min(rows_per_block, target.size(0) - lo)
        index = [slice(None)] * target.dim()
        index[0] = slice(row_start + lo, row_start + lo + b)
        if dim != 0:
            index[dim] = slice(start, start + n)
        target.narrow(0, lo, b).copy_(loaded[tuple(index)])
    return dst


def default_weight_loader(param: torch.Tensor, loaded: Loadable, shard_id: Any = None) -> None:
    """Loader of a replicated parameter (norm weights, row-parallel bias): copy it whole."""
    assert shard_id is None, f"replicated parameter got shard_id={shard_id!r}"
    check_shape(loaded, param.shape)
    param.data.copy_(loaded if isinstance(loaded, torch.Tensor) else loaded[tuple(slice(None) for _ in param.shape)])


class RowView:
    """Rows ``[start, start + length)`` (dim 0) of a :data:`Loadable`, itself lazily sliceable.

    Hands one part of a fused checkpoint tensor (Phi-3's ``qkv_proj``,
    ``gate_up_proj``) to a packed layer's ``weight_loader`` as if it were a
    tensor of its own; only the rows the loader asks for are read.
    """

    def __init__(self, loaded: Loadable, start: int, length: int) -> None:
        shape = loaded_shape(loaded)
        if start < 0 or start + length > shape[0]:
            raise ValueError(f"rows [{start}, {start + length}) outside a checkpoint tensor of shape {list(shape)}")
        self.loaded, self.start, self.shape = loaded, start, (length, *shape[1:])

    def get_shape(self) -> list:
        return list(self.shape)

    def __getitem__(self, index: Tuple[slice, ...]) -> torch.Tensor:
        if not isinstance(index, tuple):
            index = (index,)
        rows = range(*(index[0] if index else slice(None)).indices(self.shape[0]))
        if rows.step != 1:
            raise ValueError(f"only step-1 slices are supported, got {index}")
        outer = (slice(self.start + rows.start, self.start + rows.stop), *index[1:])
        if isinstance(self.loaded, torch.Tensor):
            return self.loaded[outer]
        full = outer + (slice(None),) * (len(self.shape) - len(outer))
        return self.loaded[full]
