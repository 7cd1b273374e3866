"""Drafting with the draft head inside a step: the driver steers, every rank computes.

Speculative method ``draft-head``.  The scheduler reserves ``k`` draft
positions per decode request (:data:`~tpguide.speculative.verify.DRAFT_PENDING` placeholders, counted in
the token budget); before the step's plan is built the engine runs up to
``K`` drafting iterations over the requests still drafting::

    driver   fill one FULL bitmask row per guided request from its matcher
             state after golden d_1 .. d_j                   (spec_decoder)
             --broadcast DRAFT message (+ full rows)-->
    ranks    draft head: layers < L on the last token at position p + j
             (writes those layers' KV; verification overwrites it)
             -> draft logits shard [R, Dv_pad / T] -> mask through d2t with the
             full row and global draft ids -> vocab-parallel argmax -> target ids
    driver   d_{j+1} = target id; advance the matcher by it; a request stops
             drafting at -1 (the grammar allows no draft id), a stop token,
             a terminated matcher or its reserved k

then the driver rolls every matcher back by the drafts it advanced
(draft-side rollback) and replaces the placeholders by the drafts.  The
verification step is the one of ``ngram`` (:mod:`tpguide.speculative.verify`).

Drafts are greedy (deterministic), so the acceptance rule keeps speculative
output equal to non-speculative output for greedy and seeded sampling alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional

import torch

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.speculative.draft_head import DraftHead
from tpguide.speculative.draft_iteration import DraftPlan, run_draft_iteration
from tpguide.worker.runner import Message

if TYPE_CHECKING:  # the driver's scheduler output; no import at run time
    from tpguide.engine.scheduler import ScheduledRequest


def draft_with_head(guided, stop_token_ids, head: DraftHead, group: TPGroup,
                    scheduled: "List[ScheduledRequest]") -> None:
    """Replace the :data:`~tpguide.speculative.verify.DRAFT_PENDING` placeholders of ``scheduled`` by drafts (driver; collective).

    Afterwards each decode request's ``token_ids`` is ``[golden, d_1 .. d_m]``
    with ``m <= k`` reserved and ``num_draft_tokens = m``; its matcher is back
    in the state after ``golden``.

    Parameters
    ----------
    guided : SpeculativeGuidedDecoder or None
        The driver's matchers (None: no guided request yet).
    stop_token_ids : set of int
        A drafted stop token ends that request's drafting.

    Raises
    ------
    ValueError
        A matcher cannot roll its drafts back (an engine bug; the step fails).
    """
    stop_ids = stop_token_ids
    drafting = [s for s in scheduled if s.num_draft_tokens and not s.request.is_finished]
    drafts: Dict[int, List[int]] = {id(s): [] for s in drafting}
    advanced: Dict[int, int] = {id(s): 0 for s in drafting}

    def guided_slot(s: "ScheduledRequest") -> Optional[int]:
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
            seq_slots=[s.slot for s in active],
            context_lens=[s.start_position + len(drafts[id(s)]) for s in active],
            token_mask=token_mask,
        )
        C.broadcast_object(Message.for_draft(plan), group)
        tokens = run_draft_iteration(head, plan, group, token_bitmask).tolist()
        still: "List[ScheduledRequest]" = []
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
