"""The first steps of each CUDA fast-path kind checked bit for bit against the plain eager step (docs/gpu.md).

On CUDA the step runs on the fast path: persistent input buffers, and a
CUDA graph replay for a step that fits a token-count bucket
(:mod:`tpguide.worker.cuda_graphs`).  Its promise is the plain eager step's
bits: the fixed-order kernels give a row the same bits whatever the padding
(docs/gpu.md "Padding rows").  That is tested on CPU with the kernels
interpreted, but a GPU can differ from the interpreter (the compiled
kernels, the driver's graph replay), so the runner also checks it where it
runs: the first :data:`CHECKED_STEPS` steps of each kind (each bucket's
replay; the unpadded eager step on the buffers, per token-count bucket)
run the plain eager step as
well, and the two logits shards must be equal bit for bit on every rank.
A difference, or a capture that raises, turns the fast path off for the
run, with a warning that names the step; the outputs then come from the
plain eager step, which the run continues with.

The check costs one extra forward, and one host wait, per kind and checked
step: at most twice the number of buckets a run uses.
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Optional

import torch

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.worker.host_sync import allowed_host_sync

__all__ = ["CHECKED_STEPS", "FastPathCheck", "GraphCaptureError", "bit_difference"]

#: Steps of each fast-path kind (a bucket's graph; the eager step on the buffers) checked against the plain step.
CHECKED_STEPS = 2


class GraphCaptureError(RuntimeError):
    """A CUDA graph could not be captured (the runner falls back to the eager step, docs/gpu.md)."""


def bit_difference(fast: torch.Tensor, plain: torch.Tensor) -> Optional[str]:
    """Where two logits shards differ bit for bit, in words; None when they are identical.

    Parameters
    ----------
    fast, plain : Tensor, float32 [R, V_local]
        The fast path's and the plain eager step's logits of the same rows.

    Returns
    -------
    str or None
        The shapes when they differ, else the count of differing entries and
        the first one's row, column and both values; NaNs compare by their bits.
    """
    if fast.shape != plain.shape or fast.dtype != plain.dtype:
        return f"shape/dtype {tuple(fast.shape)} {fast.dtype} vs {tuple(plain.shape)} {plain.dtype}"
    if fast.numel() == 0:
        return None
    int_dtype = {4: torch.int32, 2: torch.int16, 8: torch.int64}[fast.element_size()]
    differ = fast.contiguous().view(int_dtype) != plain.contiguous().view(int_dtype)
    count = int(differ.sum())
    if count == 0:
        return None
    row, col = (int(i) for i in differ.nonzero()[0])
    return (f"{count} of {differ.numel()} logits differ, first at row {row} column {col}: "
            f"{float(fast[row, col])!r} vs {float(plain[row, col])!r}")


class FastPathCheck:
    """Counts the checked steps per fast-path kind and compares their logits over the group.

    Parameters
    ----------
    group : TPGroup
        Every rank checks the same steps (they see the same plans); the
        verdict is all-reduced, so every rank turns the fast path off together.
    steps : int
        Steps checked per kind (:data:`CHECKED_STEPS`; 0 checks none).

    Raises
    ------
    ValueError
        ``steps < 0``.
    """

    def __init__(self, group: TPGroup, steps: int = CHECKED_STEPS) -> None:
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self.group, self.steps = group, steps
        self.checked: Counter = Counter()

    def wants(self, kind: Hashable) -> bool:
        """Whether the next step of ``kind`` (e.g. ``("graph", 16)``, ``("eager", 8)``) is checked."""
        return self.checked[kind] < self.steps

    def compare(self, kind: Hashable, fast: torch.Tensor, plain: torch.Tensor) -> Optional[str]:
        """Count a checked step of ``kind``; the difference on any rank, in words, or None (a collective).

        Parameters
        ----------
        kind : hashable
        fast, plain : Tensor, float32 [R, V_local]
            This rank's logits shard from the fast path and from the plain eager step.
        """
        self.checked[kind] += 1
        with allowed_host_sync():  # a checked step's deliberate waits
            mine = bit_difference(fast, plain)
            flag = torch.tensor([0 if mine is None else 1 + self.group.tp_rank], dtype=torch.int64,
                                device=fast.device)
            worst = int(C.all_reduce(flag, self.group, op="max"))
        if worst == 0:
            return None
        rank = worst - 1
        return f"rank {rank}: " + (mine if rank == self.group.tp_rank else "differs (see that rank's log)")
