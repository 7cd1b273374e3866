"""Launch Triton kernels at any size under ``TRITON_INTERPRET=1`` and catch integer overflow in their arithmetic.

A kernel that computes ``u * stride_u`` with two int32 launch values wraps
once the product passes ``2**31 - 1`` and then reads or writes the wrong
element, silently.  Such sizes (a 70B layer's partials at thousands of
tokens) need gigabytes that a test cannot allocate, so :func:`checked_launches`
runs the interpreter on **fake tensors**: ``meta`` tensors of any shape,
given a fake base address each, whose loads return a chosen fill value and
whose stores go nowhere.  Inside it:

* every signed integer ``+``, ``-``, ``*`` and ``<<`` of a kernel is computed
  exactly as well; a result outside its type's range (int32 or int64) is
  recorded with the kernel's name;
* every address a load or store touches in an active lane must lie inside the
  fake tensor its pointer came from (a wrapped offset lands outside);
* only the last program of the grid runs (the last along every axis): the
  largest offsets of these kernels are reached there, and a grid of millions
  of programs would take hours interpreted.  ``tl.program_id`` and
  ``tl.num_programs`` answer as in the full grid.

Works with the interpreter of triton 3.6 to 3.9 (it patches
``triton.runtime.interpreter``'s builder and grid executor, restored on exit).
Used by ``tests/test_kernels_int_ranges.py``; docs/gpu.md, "Offsets at real
model sizes".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np
import torch

#: Each fake tensor's base address is a multiple of this (16 TiB apart): an
#: address's tensor is ``address >> _SPAN_BITS``.
_SPAN_BITS = 44

_CHECKED_OPS = ("multiply", "add", "subtract", "left_shift")


@dataclass
class Launches:
    """What :func:`checked_launches` saw: kernels run, and each overflow or stray address (empty when clean)."""

    kernels: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)
    fill_of: Dict[int, float] = field(default_factory=dict)  # id(tensor) -> fill (kept with the tensor below)
    keep: List[torch.Tensor] = field(default_factory=list)
    slot_fill: Dict[int, float] = field(default_factory=dict)  # this launch: tensor slot -> fill
    extents: Dict[int, Tuple[int, int, str]] = field(default_factory=dict)  # slot -> (start, end, name)
    current: str = ""
    corners: Tuple[Tuple[int, ...], ...] = ((0,), (0,), (0,))
    full_grid: Tuple[int, int, int] = (1, 1, 1)

    def fake(self, shape, dtype: torch.dtype, fill: float = 0, stride=None) -> torch.Tensor:
        """A ``meta`` tensor of ``shape`` (and ``stride``) whose loads read ``fill``."""
        t = torch.empty(shape, dtype=dtype, device="meta") if stride is None else \
            torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        self.fill_of[id(t)] = fill
        self.keep.append(t)  # its id stays its own while the context lives
        return t

    def problem(self, text: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(f"{self.current}: {text}")


def _exact_range_ok(lhs: np.ndarray, rhs: np.ndarray, op, bits: int) -> Tuple[bool, str]:
    """Whether ``op(lhs, rhs)`` of ``bits``-bit signed integers fits, computed without wrapping."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if bits <= 32:
        exact = op(lhs.astype(np.int64), rhs.astype(np.int64))
        bad = (exact < lo) | (exact > hi)
        if bad.any():
            i = int(np.argmax(bad.reshape(-1))) if exact.ndim else 0
            return False, f"{op.__name__} gives {int(exact.reshape(-1)[i])} in int{bits}"
        return True, ""
    # int64: bound with Python integers over the operands' extremes (a product's extremes are at its corners)
    a = (int(lhs.min()), int(lhs.max()))
    b = (int(rhs.min()), int(rhs.max()))
    if op is np.left_shift:
        values = [x << y for x in a for y in b if 0 <= y < 128]
    else:
        fn = {"multiply": lambda x, y: x * y, "add": lambda x, y: x + y, "subtract": lambda x, y: x - y}[op.__name__]
        values = [fn(x, y) for x in a for y in b]
    worst = max(values, key=abs)
    return (lo <= min(values) and max(values) <= hi), f"{op.__name__} reaches {worst} in int64"


@contextlib.contextmanager
def checked_launches():
    """Patch the Triton interpreter for fake-tensor, corner-grid, overflow-checked launches; yields :class:`Launches`.

    Raises
    ------
    RuntimeError
        If ``TRITON_INTERPRET=1`` was not set before triton was imported.
    """
    import triton.language as tl
    from triton.runtime import interpreter as ip

    if not hasattr(ip, "GridExecutor"):
        raise RuntimeError("triton's interpreter is missing: run with TRITON_INTERPRET=1")
    seen = Launches()
    builder = ip.InterpreterBuilder
    saved = {
        "binary_op": builder.binary_op, "create_masked_load": builder.create_masked_load,
        "create_masked_store": builder.create_masked_store, "create_get_program_id": builder.create_get_program_id,
        "create_get_num_programs": builder.create_get_num_programs,
    }
    saved_call, saved_init_args = ip.GridExecutor.__call__, ip.GridExecutor._init_args_hst
    saved_restore, saved_cvt = ip.GridExecutor._restore_args_dev, ip._implicit_cvt

    def binary_op(self, lhs, rhs, op):
        scalar = lhs.dtype.scalar
        if op.__name__ in _CHECKED_OPS and scalar.is_int_signed() and scalar.primitive_bitwidth in (32, 64):
            ok, text = _exact_range_ok(np.asarray(lhs.data), np.asarray(rhs.data), op, scalar.primitive_bitwidth)
            if not ok:
                seen.problem(text)
        return saved["binary_op"](self, lhs, rhs, op)

    def slot_of(ptrs):
        slots = np.unique(ptrs.astype(np.uint64) >> np.uint64(_SPAN_BITS))
        return [int(s) for s in slots]

    def check_addresses(ptrs, mask, what):
        active = np.asarray(ptrs)[np.broadcast_to(np.asarray(mask, dtype=bool), np.shape(ptrs))]
        if active.size == 0:
            return None
        slots = slot_of(active)
        if len(slots) != 1 or slots[0] not in seen.extents:
            seen.problem(f"{what} at addresses outside every tensor (slots {slots[:4]})")
            return None
        start, end, name = seen.extents[slots[0]]
        if int(active.min()) < start or int(active.max()) >= end:
            seen.problem(f"{what} outside {name}: bytes [{int(active.min()) - start}, {int(active.max()) - start}] "
                         f"of {end - start}")
        return slots[0]

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        if not seen.extents:
            return saved["create_masked_load"](self, ptrs, mask, other, cache_policy, is_volatile)
        dtype_tt = ptrs.get_element_ty()
        slot = check_addresses(ptrs.data, mask.data, "a load")
        value = seen.slot_fill.get(slot, 0)
        data = np.full(np.shape(ptrs.data), value, dtype=ip._get_np_dtype(dtype_tt))
        if other is not None:
            data = np.where(mask.data, data, other.data).astype(data.dtype)
        return ip.TensorHandle(data, dtype_tt)

    def masked_store(self, ptrs, value, mask, cache_policy):
        if not seen.extents:
            return saved["create_masked_store"](self, ptrs, value, mask, cache_policy)
        check_addresses(ptrs.data, mask.data, "a store")

    def program_id(self, axis):
        return ip.TensorHandle(np.array([seen.corners[axis][self.grid_idx[axis]]], dtype=np.int32), tl.int32)

    def num_programs(self, axis):
        return ip.TensorHandle(np.array([seen.full_grid[axis]], dtype=np.int32), tl.int32)

    def implicit_cvt(arg):
        if isinstance(arg, torch.Tensor) and arg.device.type == "meta":
            slot = len(seen.extents) + 1
            size = arg.element_size()
            last = sum((n - 1) * s for n, s in zip(arg.shape, arg.stride()) if n > 0) if arg.numel() else -1
            start = (slot << _SPAN_BITS)
            seen.extents[slot] = (start, start + (arg.storage_offset() + last + 1) * size,
                                  f"{arg.dtype} {list(arg.shape)}")
            seen.slot_fill[slot] = seen.fill_of.get(id(arg), 0)
            ty = tl.str_to_ty(ip.triton.runtime.jit.mangle_type(arg), None)
            return tl.tensor(ip.TensorHandle(np.array([start], dtype=np.uint64), ty), ty)
        return saved_cvt(arg)

    def init_args(self, args_dev, kwargs):
        return list(args_dev), dict(kwargs)

    def restore_args(self, args_dev, args_hst, kwargs, kwargs_hst):
        return None

    def call(self, *args, **kwargs):
        grid = self.grid

        def corner_grid(meta):
            full = grid(meta) if callable(grid) else grid
            full = tuple(int(n) for n in full) + (1,) * (3 - len(full))
            seen.full_grid = full
            seen.corners = tuple((n - 1,) for n in full)
            return tuple(len(c) for c in seen.corners)

        seen.current = getattr(self.fn, "__name__", "kernel")
        seen.kernels.append(seen.current)
        seen.extents.clear()
        seen.slot_fill.clear()
        self.grid = corner_grid
        try:
            return saved_call(self, *args, **kwargs)
        finally:
            self.grid = grid

    builder.binary_op = binary_op
    builder.create_masked_load = masked_load
    builder.create_masked_store = masked_store
    builder.create_get_program_id = program_id
    builder.create_get_num_programs = num_programs
    ip.GridExecutor.__call__ = call
    ip.GridExecutor._init_args_hst = init_args
    ip.GridExecutor._restore_args_dev = restore_args
    ip._implicit_cvt = implicit_cvt
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(builder, name, fn)
        ip.GridExecutor.__call__, ip.GridExecutor._init_args_hst = saved_call, saved_init_args
        ip.GridExecutor._restore_args_dev, ip._implicit_cvt = saved_restore, saved_cvt

