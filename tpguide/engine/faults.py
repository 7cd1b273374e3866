"""Failure paths of the SPMD loop: driver aborts and non-finite logits.

Two rules keep a failure from hanging the group (DESIGN.md §1, every rank
calls the same collectives in the same order):

* **between steps** (the driver is scheduling, advancing matchers, writing
  output) the other ranks wait in the plan broadcast.  If the driver fails
  there it broadcasts an :class:`AbortPlan` instead of the next
  :class:`~tpguide.engine.step_plan.StepPlan`; every rank raises
  :class:`DriverAborted` naming the driver's error and exits non-zero.
* **inside a step** the ranks are somewhere in the step's collectives; no
  message can be matched safely.  The failing process exits; its peers'
  next collective fails (gloo: closed socket, at once; NCCL: the collective
  timeout) and ``torchrun`` stops the remaining workers as soon as one exits
  non-zero.

A row of logits with a NaN or ``+inf`` (or no finite value) fails its
request only; :func:`nonfinite_ranks` says which ranks' shards held the
non-finite values, so the driver's message names them.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from tpguide.dist import TPGroup
from tpguide.dist import collectives as C


class DriverAborted(RuntimeError):
    """Raised on a non-driver rank when the driver broadcast an :class:`AbortPlan`."""


class AbortPlan:
    """Sent instead of a step plan when the driver fails between steps.

    Looks like a stop plan (``stop`` is True) to a loop that only checks
    ``plan.stop``; :func:`raise_if_abort` turns it into :class:`DriverAborted`.
    """

    stop = True

    def __init__(self, error: str) -> None:
        self.error = error


def abort_plan_for(exc: BaseException) -> AbortPlan:
    """The abort plan that reports ``exc`` (type and message) to the other ranks."""
    return AbortPlan(f"{type(exc).__name__}: {exc}")


def raise_if_abort(plan, group: TPGroup) -> None:
    """Raise :class:`DriverAborted` on a non-driver rank that received an :class:`AbortPlan`."""
    error = getattr(plan, "error", None)
    if error is not None:
        raise DriverAborted(f"rank {group.tp_rank}: the driver (rank 0) failed between steps and "
                            f"aborted the group: {error}")


def nonfinite_ranks(logits: torch.Tensor, group: TPGroup) -> List[List[int]]:
    """Per row, the ranks whose logits shard holds a NaN or ``+inf`` (a collective).

    Call it on every rank, only when the sampler flagged a bad row (the flag
    is identical on every rank, so every rank makes the same call).

    Parameters
    ----------
    logits : torch.Tensor
        This rank's shard, fp32 ``[rows, V_local]``, after the bitmask.

    Returns
    -------
    list of list of int
        ``result[row]``: the tp ranks with a NaN / ``+inf`` in that row (empty
        for a row that is merely all ``-inf``); the same on every rank.
    """
    local = (torch.isnan(logits) | (logits == float("inf"))).any(dim=-1).to(torch.int32)  # [rows]
    flags = C.all_gather_stacked(local, group).cpu()  # [tp_size, rows]
    return [flags[:, row].nonzero().flatten().tolist() for row in range(flags.shape[1])]


def describe_bad_rows(ranks_per_row: List[List[int]]) -> Dict[int, str]:
    """``{row: why}`` for the driver's error message (rows with no NaN/+inf say all -inf)."""
    return {
        row: (f"NaN or +inf logits on rank(s) {ranks}" if ranks
              else "no finite logit (every token -inf) or a padded id won")
        for row, ranks in enumerate(ranks_per_row)
    }
