"""What a CUDA graph would replay: a forward's aten ops and Triton launches, recorded on CPU (no tests of its own).

A graph captured on a padding-only step replays that step's kernels with
that step's launch arguments and addresses; the host code of a later step
does not run.  So a captured forward is right for a real step of the same
bucket only if the real step's eager forward would run the very same
sequence: the same ops on the same shapes, the same Triton grids and scalar
arguments, reading the same persistent tensors (parameters, KV pool, step
buffers) at the same addresses.  And it must not read a value on the host
(a capture fails on it).  :class:`StepTrace` records that sequence under
``TRITON_INTERPRET=1`` with the CUDA code path forced (docs/gpu.md).
"""

from __future__ import annotations

import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

#: aten ops that read a device value on the host or give a data-dependent shape (not capturable)
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select", "is_nonzero", "equal",
              "_unique2", "unique_dim", "unique_consecutive", "masked_scatter"}
#: aten ops that turn host data into a tensor: on CUDA a copy from pageable memory, unless a 0-dim value
#: (``x[i:] = float("-inf")`` makes a CPU scalar that CUDA's setitem applies as a fill)
HOST_DATA = {"lift_fresh", "lift_fresh_copy"}


class StepTrace(TorchDispatchMode):
    """Records ``(op, arguments)`` events; a tensor argument is described by address when it outlives the forward.

    Tensors whose storage was first made by an op inside the trace are
    temporaries (the graph's private pool: only shape, stride and dtype
    count); every other tensor (parameters, KV pool, step buffers) is named
    by its data pointer, as a graph would hold it.

    Attributes
    ----------
    events : list of tuple
        One per aten op or Triton launch, in order.
    host_reads : list of str
        Ops of :data:`HOST_READS`, boolean indexing and host data of :data:`HOST_DATA` met, with their
        events and the Python stack.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events, self.host_reads = [], []
        self._external, self._temporary = set(), set()

    def describe(self, value):
        """A comparable description of an argument (tensors by address or as temporaries)."""
        if isinstance(value, torch.Tensor):
            ptr = value.untyped_storage().data_ptr()
            layout = (tuple(value.shape), tuple(value.stride()), str(value.dtype))
            if ptr in self._temporary:
                return ("tmp", *layout)
            self._external.add(ptr)
            return ("ext", value.data_ptr(), *layout)
        if isinstance(value, (list, tuple)):
            return tuple(self.describe(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, self.describe(v)) for k, v in value.items()))
        return repr(value)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in HOST_DATA:  # a tensor made from host data: its values count, and it is a temporary
            event = (str(func), ("host", args[0].tolist()))
        else:
            event = (str(func), self.describe(args), self.describe(kwargs))
        host_data = name in HOST_DATA and args[0].dim() > 0
        if name in HOST_READS or host_data or (name == "index" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_leaves(args[1:]))):
            where = "".join(traceback.format_stack(limit=8)[:-1])
            self.host_reads.append(f"{name}: {event}\n{where}")
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (name in HOST_DATA or t.untyped_storage().data_ptr() not in self._external):
                self._temporary.add(t.untyped_storage().data_ptr())
        self.events.append(event)
        return out

    @contextlib.contextmanager
    def launches(self):
        """Also record every interpreted Triton launch: kernel, grid, arguments (constexprs included)."""
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run

        def run(kernel, *args, grid, warmup, **kwargs):
            self.events.append(("triton", kernel.fn.__name__, self.describe(grid if not callable(grid) else "fn"),
                                self.describe(args), self.describe(kwargs)))
            with _disable_current_modes():  # the interpreter's own tensor work is not the kernel's
                return original(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run
        try:
            yield self
        finally:
            InterpretedFunction.run = original


def trace(fn, *args):
    """``(result, StepTrace)`` of ``fn(*args)`` with aten ops and Triton launches recorded."""
    with StepTrace() as t, t.launches():
        result = fn(*args)
    return result, t


def first_difference(a, b):
    """``None`` when two event lists are equal, else a message naming the first differing event."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"event {i} of {len(a)} / {len(b)}:\n  captured: {x}\n  real:     {y}"
    if len(a) != len(b):
        return f"{len(a)} events captured, {len(b)} in the real step"
    return None
