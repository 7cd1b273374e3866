"""Megatron-style tensor-parallel linear layers.

``y = x W^T + b`` with ``W`` of shape ``[output_size, input_size]``:

* **column parallel**: rank ``r`` holds rows ``[r*O/T, (r+1)*O/T)`` of ``W``
  (an output slice); input replicated, output sharded, no communication;
* **row parallel**: rank ``r`` holds columns ``[r*I/T, (r+1)*I/T)`` (an input
  slice); input sharded, partial outputs summed with one ``all_reduce``, or,
  TP-invariant (``reduction_unit`` set), over fixed units of columns with one
  all-gather (:mod:`tpguide.model.invariant_reduce`).

Each parameter carries a ``weight_loader(param, loaded, shard_id=None)``
that checks the *full* checkpoint shape and copies only this rank's slice;
``loaded`` may be a tensor or a lazy safetensors slice (see
:mod:`tpguide.model.weight_slice`).  Packed layers (``qkv_proj``,
``gate_up_proj``) take a ``shard_id`` naming which checkpoint tensor is
being loaded.  Design after nano-vllm's ``layers/linear.py``, with the TP
group passed in instead of read from a global.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tpguide.dist import TPGroup
from tpguide.dist import group as collectives
from tpguide.kernels.fixed_order_cpu import kept_scratch
from tpguide.kernels.triton_path import use_triton
from tpguide.model.config import pad_heads
from tpguide.model.invariant_reduce import (
    invariant_linear,
    packed_weight,
    packs_on_cpu,
    sum_units,
    unit_partials,
    units_sum_local,
)
from tpguide.model.weight_slice import Loadable, check_shape, copy_clipped_, default_weight_loader

#: Bytes of fp32 unit partials per ordered sum of a TP-invariant row-parallel layer (tp > 1): a rank's own
#: ``[U_local, rows, O]`` on CPU (the chain), the gathered ``[tp, U_local, rows, O]`` on the CUDA path.  At
#: 32 MiB the ~1 B benchmark's first prefill held about 40 MiB more per rank at its peak than at 8 (with a
#: 1 MiB mmap threshold); tok/s at tp 2 stayed within the machine's noise (docs/benchmarks.md, "Weights held once").
PARTIALS_CHUNK_BYTES = 8 << 20


def kept_partials(num_units: int, rows: int, out_features: int) -> torch.Tensor:
    """fp32 ``[num_units, rows, out_features]`` on CPU: a buffer kept per thread and shared by every layer.

    For unit partials that live only until their ordered sum returns (one
    chunk of a row-parallel layer, one half layer of the decoder stack), so a
    long prefill does not allocate and free one per chunk and layer: that churn
    left freed blocks in glibc's heap and raised a tp 2 rank's peak RSS by
    about 50 MiB on the ~1 B benchmark (docs/benchmarks.md, "Decode-size tiles
    and kept partials").  Above :data:`PARTIALS_CHUNK_BYTES` the buffer is the call's own.
    The kernel writes every value, so what the buffer held before changes nothing.
    """
    numel = num_units * rows * out_features
    buf = kept_scratch("unit_partials", numel, torch.float32, PARTIALS_CHUNK_BYTES // 4)
    return buf[:numel].view(num_units, rows, out_features)


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``; ``ValueError`` naming both if it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tp_size={denominator}")
    return numerator // denominator


def _param(shape: Sequence[int], dtype: torch.dtype, loader) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


class ColumnParallelLinear(nn.Module):
    """Linear layer sharded on the output dimension; output stays sharded.

    Parameters
    ----------
    input_size, output_size : int
        Full (unsharded) sizes; ``output_size % tp_size == 0``.
    group : TPGroup
    bias : bool
    dtype : torch.dtype

    Attributes
    ----------
    weight : ``[output_size_per_partition, input_size]``
    bias : ``[output_size_per_partition]`` or None
    """

    def __init__(self, input_size: int, output_size: int, group: TPGroup, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.group = group
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = divide(output_size, group.tp_size, "output_size")
        self.weight = _param((self.output_size_per_partition, input_size), dtype, self.weight_loader)
        self.bias = _param((self.output_size_per_partition,), dtype, self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Loadable, shard_id: Any = None) -> None:
        """Copy rows ``[tp_rank * O/T, (tp_rank + 1) * O/T)`` of the full ``[O, I]`` (or ``[O]``) tensor."""
        check_shape(loaded, (self.output_size, *param.shape[1:]))
        copy_clipped_(param.data, loaded, 0, self.group.tp_rank * self.output_size_per_partition)

    #: Set by a TP-invariant model: the matmul runs in a fixed order
    #: (:func:`~tpguide.model.invariant_reduce.invariant_linear`), so a column's
    #: value does not depend on the shard width, the other rows or the threads.
    fixed_order: bool = False

    def prepack(self) -> None:
        """Pack the weight for the fixed-order CPU kernel now (start-up), not in the first request's forward."""
        if self.fixed_order and packs_on_cpu(self.weight):
            packed_weight(self, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, input_size] -> [T, output_size_per_partition]``."""
        if self.fixed_order:
            y = invariant_linear(x, self.weight, self, x.dtype)  # on CPU stored in x's dtype by the kernel
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed in one matrix (``gate_up_proj``).

    Rank ``r`` holds, for each packed part ``i``, rows
    ``[r*O_i/T, (r+1)*O_i/T)`` of checkpoint tensor ``i``, stacked in order:
    ``weight = [gate_r; up_r]``.

    Parameters
    ----------
    output_sizes : sequence of int
        Full size of each packed part; each divisible by ``tp_size``.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], group: TPGroup, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            divide(size, group.tp_size, "output_size")
        super().__init__(input_size, sum(self.output_sizes), group, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: Loadable, shard_id: Any = None) -> None:
        """Load packed part ``shard_id`` (an int index into ``output_sizes``)."""
        assert isinstance(shard_id, int), f"packed parameter needs an int shard_id, got {shard_id!r}"
        tp = self.group.tp_size
        check_shape(loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        copy_clipped_(param.data.narrow(0, offset, size), loaded, 0, self.group.tp_rank * size)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed, sharded by whole KV groups, with zero-head padding.

    Heads are padded with :func:`tpguide.model.config.pad_heads`; the padded
    heads sit after the real ones, so rank ``r`` holds KV heads
    ``[r*Kl, (r+1)*Kl)`` and their query heads ``[r*Hl, (r+1)*Hl)`` with
    ``Kl = num_kv_heads_padded / tp_size`` and ``Hl = Kl * group``.  Rows of
    heads past the checkpoint's count stay zero.  Local layout of ``weight``::

        [ q: Hl*D rows | k: Kl*D rows | v: Kl*D rows ]

    Parameters
    ----------
    hidden_size, head_dim : int
    total_num_heads, total_num_kv_heads : int
        Checkpoint (unpadded) head counts.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 group: TPGroup, bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        tp = group.tp_size
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads_padded, self.num_kv_heads_padded = pad_heads(total_num_heads, total_num_kv_heads, tp)
        self.num_heads = self.num_heads_padded // tp
        self.num_kv_heads = self.num_kv_heads_padded // tp
        out = (self.num_heads_padded + 2 * self.num_kv_heads_padded) * head_dim
        super().__init__(hidden_size, out, group, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: Loadable, shard_id: Any = None) -> None:
        """Load ``q_proj`` / ``k_proj`` / ``v_proj`` (``shard_id`` ``"q"``, ``"k"``, ``"v"``)."""
        d = self.head_dim
        q_rows, kv_rows = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            full, offset, size = self.total_num_heads * d, 0, q_rows
        elif shard_id in ("k", "v"):
            full, size = self.total_num_kv_heads * d, kv_rows
            offset = q_rows if shard_id == "k" else q_rows + kv_rows
        else:
            raise AssertionError(f"qkv shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        check_shape(loaded, (full, *param.shape[1:]))
        copy_clipped_(param.data.narrow(0, offset, size), loaded, 0, self.group.tp_rank * size)

    def split(self, qkv: torch.Tensor) -> List[torch.Tensor]:
        """``[T, (Hl + 2*Kl) * D] -> q [T, Hl, D], k [T, Kl, D], v [T, Kl, D]``."""
        d = self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        return [q.unflatten(-1, (-1, d)), k.unflatten(-1, (-1, d)), v.unflatten(-1, (-1, d))]


class RowParallelLinear(nn.Module):
    """Linear layer sharded on the input dimension; partial outputs summed.

    Parameters
    ----------
    input_size, output_size : int
        Full sizes; ``input_size % tp_size == 0``.  ``input_size`` may
        include zero padding (padded attention heads).
    group : TPGroup
    bias : bool
        The bias is replicated and added once (after the sum).
    reduce_results : bool
        If True, ``forward`` ends with the layer's single
        ``collectives.all_reduce`` and returns the full output on every rank.
        If False it returns this rank's partial sum (the bias added on
        ``tp_rank`` 0 only) and the caller reduces.
    org_input_size : int, optional
        Columns in the checkpoint (default ``input_size``); columns past it
        stay zero.
    dtype : torch.dtype
    reduction_unit : int, optional
        TP-invariant reduction (docs/architecture.md §6): the sum over the
        input runs over fixed units of this many columns (a head's
        ``head_dim`` for ``o_proj``, :func:`~tpguide.model.invariant_reduce.reduction_block_size`
        for ``down_proj``), each in fp32, combined in unit order the same way
        at every ``tp_size``; units past ``org_input_size`` (padded heads)
        are skipped.  Needs ``reduce_results``.  None: a plain all-reduce.

    Attributes
    ----------
    weight : ``[output_size, input_size_per_partition]``
        With ``reduction_unit`` stored transposed (strides ``(1, output_size)``),
        so ``weight.t().view(U_local, reduction_unit, output_size)`` is the
        contiguous per-unit layout the CUDA ``bmm`` reads (on CPU the
        fixed-order kernel reads a packed copy).
    bias : ``[output_size]`` or None

    Raises
    ------
    ValueError
        Sizes that do not divide (the message names them).
    """

    def __init__(self, input_size: int, output_size: int, group: TPGroup, bias: bool = False,
                 reduce_results: bool = True, org_input_size: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, reduction_unit: Optional[int] = None) -> None:
        super().__init__()
        self.group = group
        self.input_size, self.output_size = input_size, output_size
        self.org_input_size = input_size if org_input_size is None else org_input_size
        self.input_size_per_partition = divide(input_size, group.tp_size, "input_size")
        self.reduce_results = reduce_results
        self.reduction_unit = reduction_unit
        if reduction_unit is None:
            self.weight = _param((output_size, self.input_size_per_partition), dtype, self.weight_loader)
        else:
            if not reduce_results:
                raise ValueError("reduction_unit (TP-invariant reduction) needs reduce_results=True")
            if reduction_unit < 1 or self.input_size_per_partition % reduction_unit \
                    or self.org_input_size % reduction_unit:
                raise ValueError(
                    f"reduction_unit={reduction_unit} must divide input_size_per_partition="
                    f"{self.input_size_per_partition} and org_input_size={self.org_input_size}"
                )
            self.num_local_units = self.input_size_per_partition // reduction_unit
            self.num_real_units = self.org_input_size // reduction_unit
            transposed = torch.zeros(self.input_size_per_partition, output_size, dtype=dtype)
            self.weight = nn.Parameter(transposed.t(), requires_grad=False)  # [O, I_local], column-major
            self.weight.weight_loader = self.weight_loader
        self.bias = _param((output_size,), dtype, default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Loadable, shard_id: Any = None) -> None:
        """Copy columns ``[tp_rank * I/T, (tp_rank + 1) * I/T)`` of the full ``[O, org_input_size]`` tensor."""
        check_shape(loaded, (self.output_size, self.org_input_size))
        copy_clipped_(param.data, loaded, 1, self.group.tp_rank * self.input_size_per_partition)

    def prepack(self) -> None:
        """Pack the weight's units for the fixed-order CPU kernel now (start-up), not in the first forward."""
        if self.reduction_unit is not None and packs_on_cpu(self.weight):
            packed_weight(self, self.weight, self.num_local_units)

    def partials_chunk_rows(self, num_rows: int) -> int:
        """Rows per unit-partials sum (:func:`~tpguide.model.invariant_reduce.sum_units`) within
        :data:`PARTIALS_CHUNK_BYTES` (at least one row; all ``num_rows`` when they fit): this rank's fp32
        ``[U_local, rows, O]`` on CPU (the chain holds no other rank's), the gathered ``[tp, U_local, rows, O]``
        on the CUDA path's all-gather.

        The same on every rank (it depends on shapes and the device only).
        Rows never influence each other's sums, so the chunking changes no bit;
        it bounds a long prefill's transient memory (at tp 2, 1,024 rows of a
        2,048-wide ``o_proj`` over 32 heads would gather 256 MiB at once).
        """
        gathers = self.group.tp_size if use_triton(self.weight) else 1
        per_row = gathers * self.num_local_units * self.output_size * 4
        return max(1, min(num_rows, PARTIALS_CHUNK_BYTES // per_row))

    def _units_sum_across_ranks(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [T, I/T]`` -> ``[T, O]`` (into ``out`` when given): this rank's unit partials, summed across ranks
        in unit order; on CPU the partials go into :func:`kept_partials`."""
        kept = None if use_triton(x) else kept_partials(self.num_local_units, x.shape[0], self.output_size)
        partials = unit_partials(x, self.weight, self.num_local_units, self, kept)  # fp32 [U_local, T, O]
        return sum_units(partials, self.num_real_units, self.group, x.dtype, out)  # the one communication point

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, input_size_per_partition] -> [T, output_size]`` (summed if ``reduce_results``).

        TP-invariant at ``tp_size > 1``: one ordered sum across ranks per :meth:`partials_chunk_rows` rows.
        """
        if self.reduction_unit is not None:
            if self.group.tp_size == 1 and self.num_real_units == self.num_local_units:
                y = units_sum_local(x, self.weight, self.num_local_units, self, x.dtype)  # [T, O], no communication
            else:
                rows = self.partials_chunk_rows(x.shape[0])
                if rows >= x.shape[0]:
                    y = self._units_sum_across_ranks(x)
                else:  # a long prefill, in chunks, each sum written into its rows
                    y = torch.empty((x.shape[0], self.output_size), dtype=x.dtype, device=x.device)
                    for start in range(0, x.shape[0], rows):
                        self._units_sum_across_ranks(x[start:start + rows], y[start:start + rows])
            return y if self.bias is None else y + self.bias
        y = F.linear(x, self.weight)
        if self.reduce_results:
            y = collectives.all_reduce(y, self.group)  # the one communication point
            return y if self.bias is None else y + self.bias
        if self.bias is not None and self.group.tp_rank == 0:
            y = y + self.bias
        return y
