"""Drafting, a phase of the step (driver): drafts proposed before scheduling, the draft head's after it.

docs/architecture.md §1 and §5.  ``Driver.schedule_step`` runs it as values, with no
callback from inside the scheduler::

    drafts    = propose_drafts(spec, guided, scheduler.decoding(), budget)   # slot -> draft tokens
    scheduled = scheduler.schedule(drafts)       # each keeps the prefix its token budget allows
    (draft-head) head_draft_requests(scheduled, guided) -> the drafting loop -> with_head_drafts(...)

The drafts of a decoding request are proposed with the whole step's token
budget and the scheduler cuts them to the budget left for it, as vLLM's
scheduler cuts a request's ``spec_token_ids``.  Every drafter's drafts with
a smaller budget are a prefix of those with a larger one, so the cut
drafts are the ones a proposal with the smaller budget gives.  The
speculator sees each request as a :class:`~tpguide.speculative.propose.DraftInput`
of plain values (:func:`draft_input_of`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence

from tpguide.engine.request import Request
from tpguide.engine.scheduler import ScheduledRequest
from tpguide.speculative.draft_loop import DraftRequest
from tpguide.speculative.propose import DRAFT_PENDING, DraftInput, Speculator


def draft_input_of(req: Request) -> DraftInput:
    """``req`` as the drafters see it (its token lists are shared, not copied)."""
    sp = req.sampling_params
    return DraftInput(slot=req.slot, prompt_token_ids=req.prompt_token_ids, output_token_ids=req.output_token_ids,
                      max_tokens=sp.max_tokens, has_penalties=sp.has_penalties,
                      structured_output=req.structured_output)


def propose_drafts(spec: Speculator, guided, decoding: Iterable[Request], budget: int) -> Dict[int, List[int]]:
    """Per slot of each decoding request: its drafts for this step (``draft-head``: placeholders).

    Parameters
    ----------
    spec : Speculator
    guided : GuidedDecoder or None
        The driver's records (a guided request drafts its forced text first).
    decoding : iterable of Request
        The running requests past their prompt (:meth:`Scheduler.decoding`).
    budget : int
        The step's token budget (``max_num_batched_tokens``); the scheduler cuts each list further.
    """
    return {req.slot: spec.propose(draft_input_of(req), budget,
                                   guided if req.structured_output is not None else None)
            for req in decoding}


def head_draft_requests(scheduled: Sequence[ScheduledRequest], guided) -> List[DraftRequest]:
    """The draft-head drafting loop's input: the scheduled requests holding :data:`DRAFT_PENDING` positions."""
    return [DraftRequest(slot=s.slot, last_token=s.token_ids[0], position=s.start_position,
                         max_drafts=s.num_draft_tokens,
                         guided=(guided is not None and s.request.structured_output is not None
                                 and guided.is_guided(s.slot) and not guided.record(s.slot).is_thinking),
                         block_table=list(s.request.block_ids))
            for s in scheduled if _holds_placeholders(s)]


def with_head_drafts(scheduled: Sequence[ScheduledRequest],
                     drafts: Optional[Sequence[List[int]]]) -> List[ScheduledRequest]:
    """``scheduled`` with its :data:`DRAFT_PENDING` positions replaced by the drafting loop's ``drafts``.

    ``drafts``: one list per request of :func:`head_draft_requests`, in its
    order (None: no loop ran).  Requests that drafted their forced text keep those drafts.
    """
    if drafts is None:
        return list(scheduled)
    found = iter(drafts)
    out = []
    for s in scheduled:
        if _holds_placeholders(s):
            head = next(found)
            s = dataclasses.replace(s, token_ids=s.token_ids[:1] + head, num_draft_tokens=len(head))
        elif s.num_draft_tokens and s.token_ids[1] == DRAFT_PENDING:  # failed before the loop: no drafts
            s = dataclasses.replace(s, token_ids=s.token_ids[:1], num_draft_tokens=0)
        out.append(s)
    return out


def _holds_placeholders(s: ScheduledRequest) -> bool:
    return bool(s.num_draft_tokens) and s.token_ids[1] == DRAFT_PENDING and not s.request.is_finished
