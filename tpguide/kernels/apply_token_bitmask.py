"""Dispatcher of :func:`apply_token_bitmask_inplace`: validates, then picks a backend.

Backends are imported lazily, so a CPU-only install never imports Triton (and
the C CPU kernel is compiled only when first used).
"""

from __future__ import annotations

import torch

from tpguide.kernels.bitmask_layout import BITS_PER_WORD

LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Values accepted by ``backend=``.
BACKENDS = ("auto", "cpu", "torch", "triton", "reference")
_IMPLS: dict = {}  # backend name -> its function, imported on first use


def apply_token_bitmask_inplace(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    token_mask: torch.Tensor | None = None,
    d2t: torch.Tensor | None = None,
    vocab_start_index: int = 0,
    draft_vocab_start_index: int = 0,
    backend: str = "auto",
) -> None:
    """Set the logits of tokens the grammar disallows to ``-inf``, in place.

    Two layouts (docs/architecture.md §2, §3):

    * **Vocab shard** (``d2t is None``): ``logits[:, j]`` is global token
      ``vocab_start_index + j`` and ``bitmask`` is this rank's word slice, whose
      first word is global word ``vocab_start_index // 32``; so column ``j``
      reads bit ``j`` of the slice.  Columns past ``32 * num_words`` are
      disallowed; padding bits past ``width`` are never read.
    * **Draft shard** (``d2t`` given): column ``j`` is draft id
      ``g = draft_vocab_start_index + j`` with target id ``g + d2t[j]``
      (``d2t`` is this rank's slice, indexed locally, with the global draft
      id), and ``bitmask`` is the **full** target row.  Target ids outside
      ``[0, 32 * num_words)`` are disallowed.

    Algorithm after xgrammar's ``apply_token_bitmask_inplace`` kernels and
    TensorRT-LLM's ``logitsBitmask`` kernel (token mask and ``d2t`` gather).

    Parameters
    ----------
    logits : torch.Tensor
        ``[num_rows, width]`` float32, float16 or bfloat16, any strides (e.g. a
        column slice of a wider tensor).  Modified in place.
    bitmask : torch.Tensor
        ``[num_rows, num_words]`` int32 ``token_bitmask`` words, same device,
        any strides.  Bit ``i`` of word ``w`` set = position ``32*w + i`` allowed.
    token_mask : torch.Tensor, optional
        ``[num_rows]`` int32, same device; rows where it is 0 are untouched.
    d2t : torch.Tensor, optional
        ``[width]`` int32 draft-to-target offsets of this draft shard.
    vocab_start_index : int
        First global token of this logits shard; a multiple of 32 (must be 0
        with ``d2t``).
    draft_vocab_start_index : int
        First global draft id of this shard (only with ``d2t``).
    backend : {"auto", "cpu", "torch", "triton", "reference"}
        ``"auto"``: see :func:`resolve_backend`.  ``"cpu"``: the compiled C
        kernel (CPU tensors).  ``"torch"``: the vectorised torch/NumPy path.

    Raises
    ------
    TypeError
        A tensor argument has the wrong type or dtype.
    ValueError
        Shapes, devices, indices or ``backend`` are invalid.
    RuntimeError
        ``backend="cpu"`` but the C kernel cannot be compiled on this machine.
    """
    _check_args(logits, bitmask, token_mask, d2t, vocab_start_index, draft_vocab_start_index)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if logits.shape[0] == 0 or logits.shape[1] == 0:
        return
    if backend == "auto":  # resolve_backend, without building a torch.device per call
        backend = "triton" if logits.is_cuda else "cpu" if logits.is_cpu and _cpu_kernel_loads() else "torch"
    impl = _IMPLS.get(backend) or _import_impl(backend)
    impl(logits, bitmask, token_mask=token_mask, d2t=d2t, draft_vocab_start_index=draft_vocab_start_index)


def resolve_backend(backend: str = "auto", device: torch.device | str = "cpu") -> str:
    """The backend ``backend=`` selects for tensors on ``device``.

    ``"auto"`` is ``"triton"`` on CUDA; elsewhere ``"cpu"`` (the C kernel) when
    it compiles and loads on this machine, else ``"torch"`` (the reason is
    logged once at debug level).  Any other name is returned unchanged.

    Raises
    ------
    ValueError
        ``backend`` is not one of :data:`BACKENDS`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    device_type = torch.device(device).type
    if device_type == "cuda":
        return "triton"
    return "cpu" if device_type == "cpu" and _cpu_kernel_loads() else "torch"


def _cpu_kernel_loads() -> bool:
    """Whether the C CPU kernel compiles and loads here (tried once per process)."""
    from tpguide.kernels import apply_token_bitmask_cpu

    return apply_token_bitmask_cpu.load_cpu_kernel() is not None


def _import_impl(backend: str):
    if backend == "cpu":
        from tpguide.kernels.apply_token_bitmask_cpu import apply_token_bitmask_inplace_cpu as impl
    elif backend == "torch":
        from tpguide.kernels.apply_token_bitmask_torch import apply_token_bitmask_inplace_torch as impl
    elif backend == "triton":
        from tpguide.kernels.apply_token_bitmask_triton import apply_token_bitmask_inplace_triton as impl
    else:
        from tpguide.kernels.apply_token_bitmask_reference import (
            apply_token_bitmask_inplace_reference as impl,
        )
    _IMPLS[backend] = impl
    return impl


def _check_tensor(name: str, value, ndim: int, dtypes: tuple, device: torch.device | None) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}.dtype must be one of ({allowed}), got {value.dtype}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} is on {value.device} but logits is on {device}")


def _check_args(logits, bitmask, token_mask, d2t, vocab_start_index, draft_vocab_start_index) -> None:
    """Raise ``TypeError``/``ValueError`` naming the offending and the allowed values."""
    _check_tensor("logits", logits, 2, LOGITS_DTYPES, None)
    num_rows, width = logits.shape
    _check_tensor("bitmask", bitmask, 2, (torch.int32,), logits.device)
    if bitmask.shape[0] != num_rows:
        raise ValueError(
            f"bitmask has {bitmask.shape[0]} rows but logits has {num_rows} "
            f"(bitmask shape {tuple(bitmask.shape)}, logits shape {tuple(logits.shape)})"
        )
    for name, value in (("vocab_start_index", vocab_start_index),
                        ("draft_vocab_start_index", draft_vocab_start_index)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if vocab_start_index % BITS_PER_WORD != 0:
        raise ValueError(
            f"vocab_start_index={vocab_start_index} is not a multiple of {BITS_PER_WORD}: "
            "the bitmask word slice would not line up with the logits shard"
        )
    if token_mask is not None:
        _check_tensor("token_mask", token_mask, 1, (torch.int32,), logits.device)
        if token_mask.shape[0] != num_rows:
            raise ValueError(f"token_mask has {token_mask.shape[0]} entries but logits has {num_rows} rows")
    if d2t is None:
        if draft_vocab_start_index != 0:
            raise ValueError(
                f"draft_vocab_start_index={draft_vocab_start_index} needs d2t (draft shards only)"
            )
        return
    _check_tensor("d2t", d2t, 1, (torch.int32,), logits.device)
    if d2t.shape[0] != width:
        raise ValueError(f"d2t has {d2t.shape[0]} entries but logits has width {width}")
    if vocab_start_index != 0:
        raise ValueError(
            f"vocab_start_index must be 0 with d2t (the bitmask is the full target row), "
            f"got {vocab_start_index}"
        )
