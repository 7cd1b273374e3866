"""Kernels: a grammar's packed bitmask applied to a logits shard, and the model's fixed-order CPU and Triton kernels.

docs/architecture.md §8.  The bitmask: one file per backend, named after its
function (as in xgrammar's ``python/xgrammar/kernels/``), plus a dispatcher
that validates the arguments:

* :mod:`.apply_token_bitmask` -- public entry point and ``backend=`` dispatch;
* :mod:`.apply_token_bitmask_reference` -- plain-torch bool-mask oracle;
* :mod:`.apply_token_bitmask_cpu` -- C kernel compiled on first use (CPU default);
* :mod:`.apply_token_bitmask_torch` -- vectorised torch path (CPU fallback, any device);
* :mod:`.apply_token_bitmask_triton` -- Triton kernel (CUDA default).

The model's kernels: :mod:`.fixed_order_cpu` (matmuls, attention and RMS
statistics in one fixed order of fused multiply-adds) and :mod:`.fused_cpu`
(the fused element-wise kernels) on CPU; on CUDA the ``*_triton.py`` kernels,
the path chosen by :mod:`.triton_path`.
"""

from tpguide.kernels.apply_token_bitmask import BACKENDS, apply_token_bitmask_inplace

__all__ = ["BACKENDS", "apply_token_bitmask_inplace"]
