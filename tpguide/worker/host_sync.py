"""A host wait on the device that is meant to be there: sync debug mode lifted for it alone (docs/gpu.md)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["allowed_host_sync"]


@contextlib.contextmanager
def allowed_host_sync() -> Iterator[None]:
    """Lift ``torch.cuda.set_sync_debug_mode`` inside the block, restore it after (a no-op without CUDA).

    For the step's one read of the sampled ids and the fast path's checked
    steps (:mod:`tpguide.worker.fast_path_check`), so that a profile under
    sync debug mode ``"error"`` or ``"warn"`` reports only the waits nobody meant.
    """
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
