"""Token-bitmask kernels: apply a grammar's packed bitmask to a logits shard in place.

One file per backend, named after its function (as in xgrammar's
``python/xgrammar/kernels/``), plus a dispatcher that validates the arguments:

* :mod:`.apply_token_bitmask` -- public entry point and ``backend=`` dispatch;
* :mod:`.apply_token_bitmask_reference` -- plain-torch bool-mask oracle;
* :mod:`.apply_token_bitmask_cpu` -- C kernel compiled on first use (CPU default);
* :mod:`.apply_token_bitmask_torch` -- vectorised torch path (CPU fallback, any device);
* :mod:`.apply_token_bitmask_triton` -- Triton kernel (CUDA default).
"""

from tpguide.kernels.apply_token_bitmask import BACKENDS, apply_token_bitmask_inplace

__all__ = ["BACKENDS", "apply_token_bitmask_inplace"]
