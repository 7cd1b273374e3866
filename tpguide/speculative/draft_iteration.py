"""One draft-head drafting iteration on every rank (speculative method ``draft-head``).

The driver steers the drafting loop (:mod:`tpguide.speculative.draft_loop`);
each iteration it broadcasts a DRAFT message with a :class:`DraftPlan`, and
every rank runs :func:`run_draft_iteration`: the draft head's layers on each
request's last token, the draft LM-head shard, the full guided bitmask rows
through the sharded ``d2t`` with global draft ids (docs/architecture.md §3),
and a vocab-parallel argmax.  Nothing here reads driver state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.model.attention import AttentionMetadata
from tpguide.speculative.draft_head import DraftHead, apply_draft_bitmask_inplace, draft_greedy


@dataclass
class DraftPlan:
    """One drafting iteration for every rank (``R`` requests still drafting).

    Attributes
    ----------
    input_ids : torch.Tensor
        int64 ``[R]``: each request's last token (golden or latest draft).
    block_tables : list of list of int
        Per row: its request's KV blocks (position order).
    context_lens : list of int
        Per row: the tokens cached before it, the token's position
        (RoPE and KV write, one source as in :class:`~tpguide.worker.protocol.StepPlan`).
    token_mask : torch.Tensor or None
        int32 ``[R]``, 1 on guided rows; None when no row is guided (then no
        bitmask follows the plan).  Otherwise int32 ``[R, bitmask_size]`` full
        rows are broadcast right after it.
    """

    input_ids: torch.Tensor
    block_tables: List[List[int]]
    context_lens: List[int]
    token_mask: Optional[torch.Tensor] = None


def run_draft_iteration(head: DraftHead, plan: DraftPlan, group: TPGroup,
                        token_bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One drafting iteration on every rank (a collective: all ranks call it with the same plan).

    Parameters
    ----------
    head : DraftHead
    plan : DraftPlan
    group : TPGroup
    token_bitmask : torch.Tensor, optional
        Driver only, with a guided plan: int32 ``[R, bitmask_size]`` full rows.

    Returns
    -------
    torch.Tensor
        int64 ``[R]`` target ids of the drafts, -1 where no draft id is
        allowed; identical on every rank.
    """
    dev = group.device
    num_rows = plan.input_ids.numel()
    meta = AttentionMetadata.from_block_tables(plan.block_tables, [1] * num_rows, plan.context_lens, device=dev)
    hidden = head(plan.input_ids.to(dev), meta.token_positions, meta)  # [R, H]
    logits = head.lm_head.compute_draft_logits(hidden)  # [R, Dv_pad / T] fp32
    if plan.token_mask is not None:
        words = head.target.vocab_shard.bitmask_size
        if token_bitmask is None:
            token_bitmask = torch.empty((num_rows, words), dtype=torch.int32)
        token_bitmask = C.broadcast_tensor(token_bitmask.to(dev).contiguous(), group)
        apply_draft_bitmask_inplace(logits, token_bitmask, head.lm_head, plan.token_mask.to(dev))
    return draft_greedy(logits, head.lm_head).cpu()
