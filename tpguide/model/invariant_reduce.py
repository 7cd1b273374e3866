"""TP-invariant row-parallel reductions (docs/architecture.md §6).

A row-parallel layer ``y = x W^T`` with ``W [O, I]`` sums over ``I``.  Split
over ranks, each rank sums its columns and an all-reduce adds the parts, so
a different ``tp_size`` is a different order of floating-point additions and
bf16 logits (then tokens) change with ``tp_size``.  Here the sum runs over
fixed **reduction units** instead, independent of ``tp_size``::

    I columns   | unit 0 | unit 1 | unit 2 | ... | unit U-1 | padded units |
    tp 2 ranks  [ rank 0 ......... ][ rank 1 ............................ ]
    tp 3 ranks  [ rank 0 ...][ rank 1 ...][ rank 2 ....................... ]

* ``o_proj``: one unit per attention head (``head_dim`` columns); zero-padded
  heads sit after the real ones and are dropped before the sum;
* ``down_proj``: blocks of :func:`reduction_block_size` columns, chosen so
  that the shard boundary of every size in :data:`INVARIANT_TP_SIZES` is a
  block boundary.

Each rank computes its units' fp32 partials and the ``U`` real units are
added in unit order: on CPU by passing the running sum from rank to rank
(:func:`chained_units_sum`: ``[T, O]`` per message, then one broadcast), on
the CUDA path by all-gathering them (``[tp_size, U_local, T, O]``: the same
units in the same order on every rank, ``U`` times the bytes of a plain
all-reduce, one collective).  At tp 1 the kernel adds the units as it goes,
with the same additions.

Every matmul of the invariant path, the per-unit partials
(:func:`unit_partials`) and the column-parallel layers and LM head
(:func:`invariant_linear`, whose shard width changes with ``tp_size``), runs
a kernel whose order of additions is fixed by the code, not by a library's
blocking heuristics, so no element depends on the other rows, the columns
per call or the thread count (docs/architecture.md §6, "Fixed-order reductions"):

* CPU: the fixed-order C kernels (:mod:`tpguide.kernels.fixed_order_cpu`)
  on weights packed once per layer (:func:`packed_weight`);
* CUDA: the fixed-tiling Triton kernel
  (:mod:`tpguide.kernels.matmul_fixed_tiling_triton`), chosen by
  :func:`tpguide.kernels.triton_path.use_triton` (docs/gpu.md, "Exactness on CUDA").
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from tpguide.dist import TPGroup
from tpguide.dist import group as collectives
from tpguide.kernels.fixed_order_cpu import (
    PackedWeight,
    check_out,
    linear_fixed_order,
    pack_weight,
    sum_units_fixed_order,
)
from tpguide.kernels.triton_path import use_triton
from tpguide.model.c_heap import TRIM_THRESHOLD_BYTES, trim_c_heap
from tpguide.model.held_weights import (
    hold_packed_only,
    is_released,
    pack_in_place,
    parameter_users,
)

#: The tp sizes whose results agree bit for bit (plus the running one, see
#: :func:`reduction_block_size`).
INVARIANT_TP_SIZES = (1, 2, 3, 4)


def reduction_block_size(dim: int, tp_size: int, tp_sizes: Iterable[int] = INVARIANT_TP_SIZES) -> int:
    """Columns per reduction unit of a ``dim``-wide row-parallel input (``down_proj``).

    The largest block such that every shard boundary ``k * dim / t`` for
    ``t`` in ``tp_sizes`` (those that divide ``dim``) and for ``tp_size`` is a
    block boundary: ``gcd(dim / t)``.  SmolLM2-135M: ``dim=1536`` gives 128
    (12 units).  A ``tp_size`` outside ``tp_sizes`` that needs a smaller
    block changes the units, so it agrees with the others only up to rounding.

    Raises
    ------
    ValueError
        If ``dim`` is not divisible by ``tp_size``.
    """
    if tp_size < 1 or dim % tp_size:
        raise ValueError(f"input_size={dim} is not divisible by tp_size={tp_size}")
    sizes = {t for t in tp_sizes if t >= 1 and dim % t == 0} | {tp_size}
    return math.gcd(*(dim // t for t in sizes))


def packed_weight(owner: object, weight: torch.Tensor, num_units: int = 1) -> PackedWeight:
    """``weight`` packed for the fixed-order CPU linear, cached on ``owner`` (a layer).

    Packed on first use and again if ``weight`` was replaced or updated in
    place through the parameter (a new ``data_ptr`` or ``_version``); a
    loader that writes through ``.data`` calls :func:`drop_packed_weights`.
    A weight released by :func:`prepack_weights` (its packed copy the only
    one, :mod:`tpguide.model.held_weights`) returns that copy.

    Raises
    ------
    ValueError
        A released weight asked for with another ``num_units`` than it was packed with.
    """
    if is_released(weight):
        held = weight.packed
        if held.num_units != num_units:
            raise ValueError(f"weight packed in {held.num_units} units, asked for {num_units}")
        return held
    cached = getattr(owner, "_packed_weight", None)
    if cached is None or cached.source_version != (weight.data_ptr(), weight._version) \
            or cached.num_units != num_units:
        cached = pack_weight(weight.detach(), num_units)
        owner._packed_weight = cached
    return cached


def prepack_weights(module: torch.nn.Module) -> None:
    """Pack every weight ``module`` and its children will hand the fixed-order CPU linear, now, and hold it once.

    Start-up work (the engine calls it), so that a process's first request
    does not pack the whole model in its first forward (each layer's
    ``prepack`` knows its own path; nothing is packed off the CPU or without
    the TP-invariant mode).  Each weight's checkpoint layout is freed as soon
    as it is packed (:func:`tpguide.model.held_weights.hold_packed_only`: the
    parameter becomes a data-less placeholder carrying the packed copy, in
    every module sharing it), so a rank holds its weights once and the
    start-up's peak is one layer's packed copy above that; the LM head (a
    module with ``packs_in_place``, the largest weight) is packed into its own
    storage where its panels fit it (:func:`~tpguide.model.held_weights.pack_in_place`),
    so not even its copy sits beside it.  The freed layouts' heap pages go
    back to the system (:func:`~tpguide.model.c_heap.trim_c_heap`) after each
    :data:`~tpguide.model.c_heap.TRIM_THRESHOLD_BYTES` of them and at the end,
    not after every weight (a mixture of experts has thousands, and each trim
    walks the whole heap).  A second call packs nothing new.
    """
    users, untrimmed = parameter_users(module), 0
    for m in module.modules():
        prepack = getattr(m, "prepack", None)
        if not callable(prepack):
            continue
        weight = getattr(m, "weight", None)
        if getattr(m, "packs_in_place", False) and getattr(m, "fixed_order", False) and \
                isinstance(weight, torch.nn.Parameter) and not is_released(weight) and packs_on_cpu(weight):
            m._packed_weight = pack_in_place(weight)  # released below: its storage now holds the panels
        prepack()
        packed, weight = getattr(m, "_packed_weight", None), getattr(m, "weight", None)
        if packed is not None and isinstance(weight, torch.nn.Parameter) and not is_released(weight):
            untrimmed += weight.numel() * weight.element_size()
            hold_packed_only(weight, packed, users)
            del weight
            if untrimmed >= TRIM_THRESHOLD_BYTES:  # freed layouts' pages go back before the next layers pack
                trim_c_heap()
                untrimmed = 0
    if untrimmed:
        trim_c_heap()


def packs_on_cpu(weight: torch.Tensor) -> bool:
    """Whether the fixed-order linear would pack ``weight``: it lives on the CPU and the CUDA path is not forced."""
    return weight.device.type == "cpu" and not use_triton(weight)


def drop_packed_weights(module: torch.nn.Module) -> None:
    """Forget the packed weights of ``module`` and its children (after their weights were loaded)."""
    for m in module.modules():
        if getattr(m, "_packed_weight", None) is not None:
            m._packed_weight = None


def unit_partials(x: torch.Tensor, weight: torch.Tensor, num_units: int, owner: object,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-unit products of this rank's columns.

    Parameters
    ----------
    x : torch.Tensor
        ``[T, U_local * B]`` model dtype (tokens, this rank's input columns).
    weight : torch.Tensor
        ``[O, U_local * B]`` model dtype (any strides).
    num_units : int
        ``U_local``.
    owner : object
        The layer that caches the packed weight (CPU).
    out : torch.Tensor, optional
        CPU only: a contiguous fp32 ``[U_local, T, O]`` to write into (a kept buffer).

    Returns
    -------
    torch.Tensor
        fp32 ``[U_local, T, O]``: ``out[u] = x[:, u*B:(u+1)*B] @ weight[:, u*B:(u+1)*B].T``.
    """
    if use_triton(x):
        from tpguide.kernels.matmul_fixed_tiling_triton import bmm_fixed_tiling

        block = x.shape[1] // num_units
        xu = x.reshape(x.shape[0], num_units, block).transpose(0, 1)  # [U_local, T, B]
        weight_units = weight.t().reshape(num_units, block, weight.shape[0])  # [U_local, B, O]
        return bmm_fixed_tiling(xu, weight_units)  # fp32 accumulation, one order for every shape
    return linear_fixed_order(x, packed_weight(owner, weight, num_units), sum_units=False, out=out)


def units_sum_local(x: torch.Tensor, weight: torch.Tensor, num_units: int, owner: object,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[T, O]`` of ``out_dtype``: the ``num_units`` units' products added in unit order (fp32), without communication.

    The additions of :func:`sum_units` over :func:`unit_partials` (tp 1, no
    padded units), then one rounding to ``out_dtype`` (on CPU at the kernel's
    store, the bits of ``.to(out_dtype)``; docs/architecture.md §6).
    """
    if use_triton(x):
        return sum_units_fixed_order_cuda(unit_partials(x, weight, num_units, owner), out_dtype)
    return linear_fixed_order(x, packed_weight(owner, weight, num_units), sum_units=True, out_dtype=out_dtype)


def sum_units_fixed_order_cuda(partials: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp32 ``[U, T, O] -> [T, O]`` of ``out_dtype`` on the CUDA path: ``((p0 + p1) + p2) + ...``, rounded once.

    One launch (:func:`tpguide.kernels.sum_units_triton.sum_units_triton`),
    the bits of ``partials[0].clone()`` plus each later unit in place, then
    ``.to(out_dtype)``.
    """
    from tpguide.kernels.sum_units_triton import sum_units_triton

    return sum_units_triton(partials, out_dtype)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, owner: object,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``F.linear(x, weight)`` whose columns do not depend on how many rows ``weight`` has, nor on ``x``'s other rows.

    ``x [T, K]``, ``weight [N, K]`` -> ``[T, N]`` of ``out_dtype`` (one rounding
    from the fp32 accumulation, then one to ``out_dtype``: on CPU at the
    kernel's store, the bits of ``.to(out_dtype)``).  CUDA: the fixed-tiling
    Triton kernel; CPU: the fixed-order C kernel on the weight packed and
    cached on ``owner``.
    """
    if use_triton(x):
        from tpguide.kernels.matmul_fixed_tiling_triton import linear_fixed_tiling

        return linear_fixed_tiling(x, weight, out_dtype)  # rounded at the kernel's store
    return linear_fixed_order(x, packed_weight(owner, weight), out_dtype=out_dtype)


def sum_units(partials: torch.Tensor, num_real_units: int, group: TPGroup,
              out_dtype: torch.dtype = torch.float32, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gather every rank's unit partials and sum the real units in unit order.

    Parameters
    ----------
    partials : torch.Tensor
        fp32 ``[U_local, T, O]``, this rank's units (global units
        ``tp_rank * U_local ..``); the same shape on every rank.
    num_real_units : int
        Units before the zero padding (``U <= tp_size * U_local``).
    group : TPGroup
        The communication: on CPU the chain of :func:`chained_units_sum`, on the
        CUDA path one all-gather (nothing at tp 1).
    out_dtype : torch.dtype
        The result's dtype: the fp32 sum rounded once (``.to(out_dtype)``).
    out : torch.Tensor, optional
        A contiguous ``[T, O]`` of ``out_dtype`` to write the result into
        (a long prefill's chunk, straight into its rows of the layer's output).

    Returns
    -------
    torch.Tensor
        ``[T, O]`` of ``out_dtype``, identical on every rank and at every tp size
        (``out`` when given).
    """
    if group.tp_size > 1 and not use_triton(partials):  # CPU: a running sum, not every unit to every rank
        return chained_units_sum(partials, num_real_units, group, out_dtype, out)  # checks out itself
    if out is not None:
        check_out(out, tuple(partials.shape[1:]), out_dtype, partials.device)
    gathered = collectives.all_gather_stacked(partials, group).flatten(0, 1)  # [tp * U_local, T, O]
    real = gathered[:num_real_units]
    if use_triton(real):
        result = sum_units_fixed_order_cuda(real, out_dtype)
    else:
        result = sum_units_fixed_order(real).to(out_dtype)  # [T, O], unit order
    return result if out is None else out.copy_(result)


def chained_units_sum(partials: torch.Tensor, num_real_units: int, group: TPGroup,
                      out_dtype: torch.dtype = torch.float32, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`sum_units`'s result with the running sum passed from rank to rank instead of every unit gathered.

    Rank ``r`` holds units ``r * U_local ..``: it receives the fp32 sum of the
    units before its own from rank ``r - 1`` (rank 0 starts from its first
    unit), adds its real units in order (:func:`sum_units_fixed_order` with
    ``init``: the same fp32 additions in the same order as the gathered sum,
    so the same bits), and sends the sum on; the last rank rounds it to
    ``out_dtype`` once and broadcasts it.  Bytes moved: ``[T, O]`` per rank
    instead of ``[tp, U_local, T, O]`` to every rank, and no rank holds the
    other ranks' partials.  ``partials`` fp32 ``[U_local, T, O]`` on CPU;
    returns ``[T, O]`` of ``out_dtype`` on every rank (written into ``out``,
    a contiguous ``[T, O]`` of ``out_dtype``, when given).  Faster than the
    all-gather on gloo in every case measured (tp 2 and 4, decode steps of the
    embedded model included; docs/benchmarks.md, "The decoder stack in one call").
    """
    rank, tp, local = group.tp_rank, group.tp_size, partials.shape[0]
    if out is not None:
        check_out(out, tuple(partials.shape[1:]), out_dtype, partials.device)
    real = partials[:max(0, min(local, num_real_units - rank * local))]  # [U_real_here, T, O]
    running = None
    if rank > 0:
        running = collectives.recv_tensor(torch.empty(partials.shape[1:], dtype=torch.float32), rank - 1, group)
    running = sum_units_fixed_order(real, running)  # fp32 [T, O]: every unit so far, in unit order
    if out is None:
        out = torch.empty(partials.shape[1:], dtype=out_dtype)
    if rank < tp - 1:
        collectives.send_tensor(running, rank + 1, group)
    else:
        out.copy_(running)  # the one rounding to out_dtype, as .to(out_dtype)
    return collectives.broadcast_tensor(out, group, src=tp - 1)
