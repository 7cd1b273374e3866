"""Drafting with the draft head inside a step: the driver steers, every rank computes.

Speculative method ``draft-head``.  The scheduler reserves ``k`` draft
positions per decode request (:data:`~tpguide.speculative.propose.DRAFT_PENDING` placeholders, counted in
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
drafter.  :class:`HeadDrafting` is the driver's side of the loop: the engine
asks it for each iteration's plan, broadcasts it, runs the iteration on its
own rank (:meth:`StepRunner.draft`) and hands the drafted ids back, so the
loop reads straight down from ``Engine.step`` (docs/architecture.md §1) and
this module imports nothing of the driver side or the ranks.  The
verification step is the one of ``ngram`` (:mod:`tpguide.speculative.verify`).

Drafts are greedy (deterministic), so the acceptance rule keeps speculative
output equal to non-speculative output for greedy and seeded sampling alike.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from tpguide.speculative.draft_iteration import DraftPlan


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


@dataclass(frozen=True)
class DraftStep:
    """One iteration of the drafting loop: the DRAFT plan for every rank, and the driver's full rows.

    Attributes
    ----------
    plan : DraftPlan
        What every rank runs (:func:`~tpguide.speculative.draft_iteration.run_draft_iteration`).
    token_bitmask : torch.Tensor or None
        int32 ``[R, bitmask_size]``, the FULL rows of the guided requests
        (driver only; None when none of them is guided).
    """

    plan: DraftPlan
    token_bitmask: Optional[torch.Tensor]


class HeadDrafting:
    """The driver's side of the drafting loop over ``requests`` (a context manager).

    The engine runs the loop (docs/architecture.md §1)::

        with HeadDrafting(guided, stop_token_ids, requests) as loop:
            while (step := loop.next_step()) is not None:
                <broadcast a DRAFT message of step.plan>
                loop.record(<run_draft_iteration(head, step.plan, group, step.token_bitmask)>)
        loop.drafts   # one list per request, at most max_drafts long

    On leaving the ``with``, every matcher is back in the state it had
    before (after the golden token).

    Parameters
    ----------
    guided : GuidedDecoder or None
        The driver's matchers (None: no guided request yet, so none of ``requests`` is guided).
    stop_token_ids : set of int
        A drafted stop token ends that request's drafting.
    requests : sequence of DraftRequest

    Raises
    ------
    ValueError
        A matcher cannot roll its drafts back (an engine bug; the step fails).
    """

    def __init__(self, guided, stop_token_ids, requests: Sequence[DraftRequest]) -> None:
        self.guided, self.stop_token_ids, self.requests = guided, stop_token_ids, list(requests)
        self.drafts: List[List[int]] = [[] for _ in self.requests]
        self._active = list(range(len(self.requests)))
        self._slots: List[Optional[int]] = []
        self._rollbacks = contextlib.ExitStack()
        self._cursors = {}

    def __enter__(self) -> "HeadDrafting":
        # every cursor rolls its matcher back at the end (guided/decoder.py)
        self._cursors = {r.slot: self._rollbacks.enter_context(self.guided.drafting(r.slot))
                         for r in self.requests if r.guided}
        return self

    def __exit__(self, *exc) -> None:
        self._rollbacks.close()

    def next_step(self) -> Optional[DraftStep]:
        """The next iteration over the requests still drafting; None when none is."""
        if not self._active:
            return None
        requests, drafts = self.requests, self.drafts
        self._slots = [requests[i].slot if requests[i].guided else None for i in self._active]
        token_bitmask = token_mask = None
        if any(slot is not None for slot in self._slots):
            token_bitmask, token_mask = self.guided.fill_draft_bitmask(self._slots)
            token_mask = token_mask.clone()
        plan = DraftPlan(
            input_ids=torch.tensor([(drafts[i] or [requests[i].last_token])[-1] for i in self._active],
                                   dtype=torch.int64),
            block_tables=[list(requests[i].block_table) for i in self._active],
            context_lens=[requests[i].position + len(drafts[i]) for i in self._active],
            token_mask=token_mask,
        )
        return DraftStep(plan, token_bitmask)

    def record(self, tokens: Sequence[int]) -> None:
        """The target ids the last :meth:`next_step` drafted, one per request still drafting (``-1``: none)."""
        still: List[int] = []
        for i, slot, token in zip(self._active, self._slots, tokens):
            if token < 0 or (slot is not None and not self._cursors[slot].accept(token)):
                continue
            self.drafts[i].append(token)
            if (token in self.stop_token_ids or (slot is not None and self._cursors[slot].matcher.is_terminated())
                    or len(self.drafts[i]) == self.requests[i].max_drafts):
                continue
            still.append(i)
        self._active = still
