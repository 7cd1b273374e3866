"""Drafting with the draft head inside a step: the driver steers, every rank computes.

Speculative method ``draft-head``.  The scheduler reserves ``k`` draft
positions per decode request (:data:`~tpguide.speculative.verify.DRAFT_PENDING` placeholders, counted in
the token budget); before the step's plan is built the engine runs up to
``K`` drafting iterations over the requests still drafting::

    driver   fill one FULL bitmask row per guided request from its matcher
             state after the verified tokens and d_1 .. d_j  (guided/decoder.py)
             --broadcast DRAFT message (+ full rows)-->
    ranks    draft head: layers < L on the last token at position p + j
             (writes those layers' KV; verification overwrites it)
             -> draft logits shard [R, Dv_pad / T] -> mask through d2t with the
             full row and global draft ids -> vocab-parallel argmax -> target ids
    driver   d_{j+1} = target id; advance the matcher by it; a request stops
             drafting at -1 (the grammar allows no draft id), a stop token,
             a terminated matcher or its reserved k

each guided request drafts through a cursor (:mod:`tpguide.guided.draft_cursor`)
that rolls its matcher back at the end of the loop, the discipline of every
drafter; :func:`draft_with_head` returns the drafts and the
driver puts them in its step's records.  It imports nothing of the driver
side or the ranks: the DRAFT message goes out through the ``send`` it is
given.  The verification step is the one of ``ngram``
(:mod:`tpguide.speculative.verify`).

Drafts are greedy (deterministic), so the acceptance rule keeps speculative
output equal to non-speculative output for greedy and seeded sampling alike.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, List, Sequence

import torch

from tpguide.dist import TPGroup
from tpguide.speculative.draft_head import DraftHead
from tpguide.speculative.draft_iteration import DraftPlan, run_draft_iteration


@dataclass(frozen=True)
class DraftRequest:
    """One decode request's drafting input.

    Attributes
    ----------
    slot : int
        Its matcher slot.
    last_token : int
        The token the step feeds first (the last sampled, "golden" token).
    position : int
        Absolute position of ``last_token``.
    max_drafts : int
        Draft positions the scheduler reserved (``k``); its blocks cover them.
    guided : bool
        Its matcher masks the drafts.
    block_table : list of int
        Its KV blocks in position order.
    """

    slot: int
    last_token: int
    position: int
    max_drafts: int
    guided: bool
    block_table: List[int] = ()


def draft_with_head(guided, stop_token_ids, head: DraftHead, group: TPGroup, requests: Sequence[DraftRequest],
                    send: Callable[[DraftPlan], None]) -> List[List[int]]:
    """The drafts of ``requests`` (driver; collective: ``send`` broadcasts each DRAFT plan to the ranks).

    Returns one list per request, at most ``max_drafts`` long; every matcher
    is back in the state it had before (after the golden token).

    Parameters
    ----------
    guided : GuidedDecoder or None
        The driver's matchers (None: no guided request yet, so none of ``requests`` is guided).
    stop_token_ids : set of int
        A drafted stop token ends that request's drafting.

    Raises
    ------
    ValueError
        A matcher cannot roll its drafts back (an engine bug; the step fails).
    """
    drafts: List[List[int]] = [[] for _ in requests]
    active = list(range(len(requests)))
    with contextlib.ExitStack() as rollbacks:  # every cursor rolls its matcher back at the end (guided/decoder.py)
        cursors = {r.slot: rollbacks.enter_context(guided.drafting(r.slot)) for r in requests if r.guided}
        while active:
            slots = [requests[i].slot if requests[i].guided else None for i in active]
            token_bitmask = token_mask = None
            if any(slot is not None for slot in slots):
                token_bitmask, token_mask = guided.fill_draft_bitmask(slots)
                token_mask = token_mask.clone()
            plan = DraftPlan(
                input_ids=torch.tensor([(drafts[i] or [requests[i].last_token])[-1] for i in active],
                                       dtype=torch.int64),
                block_tables=[list(requests[i].block_table) for i in active],
                context_lens=[requests[i].position + len(drafts[i]) for i in active],
                token_mask=token_mask,
            )
            send(plan)
            tokens = run_draft_iteration(head, plan, group, token_bitmask).tolist()
            still: List[int] = []
            for i, slot, token in zip(active, slots, tokens):
                if token < 0 or (slot is not None and not cursors[slot].accept(token)):
                    continue
                drafts[i].append(token)
                if (token in stop_token_ids or (slot is not None and cursors[slot].matcher.is_terminated())
                        or len(drafts[i]) == requests[i].max_drafts):
                    continue
                still.append(i)
            active = still
    return drafts
