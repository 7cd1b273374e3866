"""Drafting with the draft head inside a step: the driver steers, every rank computes (issue 4).

Speculative method ``draft-head``.  The scheduler reserves ``k`` draft
positions per decode request (:data:`~tpguide.engine.speculative.DRAFT_PENDING` placeholders, counted in
the token budget); before the step's plan is built the engine runs up to
``K`` drafting iterations over the requests still drafting::

    driver   fill one FULL bitmask row per guided request from its matcher
             state after golden d_1 .. d_j                   (spec_decoder)
             --broadcast DraftPlan (+ full rows, token_mask)-->
    ranks    draft head: layers < L on the last token at position p + j
             (writes those layers' KV; verification overwrites it)
             -> draft logits shard [R, Dv_pad / T] -> mask through d2t with the
             full row and global draft ids -> vocab-parallel argmax -> target ids
    driver   d_{j+1} = target id; advance the matcher by it; a request stops
             drafting at -1 (the grammar allows no draft id), a stop token,
             a terminated matcher or its reserved k

then the driver rolls every matcher back by the drafts it advanced
(draft-side rollback) and replaces the placeholders by the drafts.  The
verification step is the one of ``ngram`` (:mod:`tpguide.engine.speculative`).

Drafts are greedy (deterministic), so the acceptance rule keeps speculative
output equal to non-speculative output for greedy and seeded sampling alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from tpguide.dist import TPGroup
from tpguide.dist import collectives as C
from tpguide.engine.draft_head import DraftHead, apply_draft_bitmask_inplace, draft_greedy
from tpguide.engine.scheduler import ScheduledRequest
from tpguide.model.attention import AttentionMetadata


@dataclass
class DraftPlan:
    """One drafting iteration for every rank (``R`` requests still drafting).

    Attributes
    ----------
    input_ids, positions : torch.Tensor
        int64 ``[R]``: each request's last token (golden or latest draft) and its position.
    seq_slots : list of int
        KV slot per row.
    token_mask : torch.Tensor or None
        int32 ``[R]``, 1 on guided rows; None when no row is guided (then no
        bitmask follows the plan).  Otherwise int32 ``[R, bitmask_size]`` full
        rows are broadcast right after it.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_slots: List[int]
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
    meta = AttentionMetadata.from_lists(plan.seq_slots, [1] * num_rows, plan.positions.tolist(), device=dev)
    hidden = head(plan.input_ids.to(dev), plan.positions.to(dev), meta)  # [R, H]
    logits = head.lm_head.compute_draft_logits(hidden)  # [R, Dv_pad / T] fp32
    if plan.token_mask is not None:
        words = head.target.vocab_shard.bitmask_size
        if token_bitmask is None:
            token_bitmask = torch.empty((num_rows, words), dtype=torch.int32)
        token_bitmask = C.broadcast_tensor(token_bitmask.to(dev).contiguous(), group)
        apply_draft_bitmask_inplace(logits, token_bitmask, head.lm_head, plan.token_mask.to(dev))
    return draft_greedy(logits, head.lm_head).cpu()


def draft_with_head(driver, head: DraftHead, group: TPGroup, scheduled: List[ScheduledRequest]) -> None:
    """Replace the :data:`~tpguide.engine.speculative.DRAFT_PENDING` placeholders of ``scheduled`` by drafts (driver; collective).

    Afterwards each decode request's ``token_ids`` is ``[golden, d_1 .. d_m]``
    with ``m <= k`` reserved and ``num_draft_tokens = m``; its matcher is back
    in the state after ``golden``.

    Raises
    ------
    ValueError
        A matcher cannot roll its drafts back (an engine bug; the step fails).
    """
    guided = driver.guided
    stop_ids = driver.stop_token_ids
    drafting = [s for s in scheduled if s.num_draft_tokens and not s.request.is_finished]
    drafts: Dict[int, List[int]] = {id(s): [] for s in drafting}
    advanced: Dict[int, int] = {id(s): 0 for s in drafting}

    def guided_slot(s: ScheduledRequest) -> Optional[int]:
        ok = guided is not None and s.request.structured_output is not None and guided.is_guided(s.slot)
        return s.slot if ok else None

    active = list(drafting)
    while active:
        slots = [guided_slot(s) for s in active]
        token_bitmask = token_mask = None
        if any(slot is not None for slot in slots):
            token_bitmask, token_mask = guided.fill_draft_bitmask(slots)
            token_mask = token_mask.clone()
        plan = DraftPlan(
            input_ids=torch.tensor([(drafts[id(s)] or s.token_ids[:1])[-1] for s in active], dtype=torch.int64),
            positions=torch.tensor([s.start_position + len(drafts[id(s)]) for s in active], dtype=torch.int64),
            seq_slots=[s.slot for s in active],
            token_mask=token_mask,
        )
        C.broadcast_object(plan, group)
        tokens = run_draft_iteration(head, plan, group, token_bitmask).tolist()
        still: List[ScheduledRequest] = []
        for s, slot, token in zip(active, slots, tokens):
            if token < 0:
                continue
            if slot is not None:
                if not guided.advance_draft(slot, token):
                    continue
                advanced[id(s)] += 1
            drafts[id(s)].append(token)
            if (token in stop_ids or (slot is not None and guided.is_terminated(slot))
                    or len(drafts[id(s)]) == s.num_draft_tokens):
                continue
            still.append(s)
        active = still
    for s in drafting:
        if advanced[id(s)]:
            guided.rollback_drafts(s.slot, advanced[id(s)])
    for s in scheduled:
        if s.num_draft_tokens:
            found = drafts.get(id(s), [])
            s.token_ids = s.token_ids[:1] + found
            s.num_draft_tokens = len(found)
