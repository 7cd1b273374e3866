"""Non-finite logits on every rank: which ranks' shards held them (docs/architecture.md §1).

Two rules keep a failure from hanging the group (every rank calls the same
collectives in the same order):

* **between steps** the other ranks wait in the plan broadcast.  If the
  driver fails there it broadcasts an ABORT message
  (:class:`tpguide.worker.protocol.Message`); every rank raises
  :class:`~tpguide.worker.protocol.DriverAborted` naming the driver's error.
* **inside a step** the ranks are somewhere in the step's collectives; no
  message can be matched safely.  The failing process exits; its peers'
  next collective fails (gloo: closed socket, at once; NCCL: the collective
  timeout) and ``torchrun`` stops the remaining workers.

A row of logits with a NaN or ``+inf`` (or no finite value) fails its
request only; :func:`nonfinite_ranks` says which ranks' shards held the
non-finite values, so the driver's message names them.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from tpguide.dist import TPGroup
from tpguide.dist import group as C


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
