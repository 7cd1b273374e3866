"""Continuous batching with a token budget and chunked prefill (driver only).

Each step the scheduler packs, in this order, until ``max_num_batched_tokens``
is spent: one decode token for every running request past its prompt, the
next chunk of every running request still in its prompt, then new requests
admitted into free KV-cache slots (their first prompt chunk).  Requests join
and leave between steps; a freed slot is handed to the next request, whose
KV positions start at 0 again (nothing of the old request is read, because
attention only reads ``context_len`` cached positions of a slot).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional

from tpguide.engine.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes
    ----------
    request : Request
    slot : int
        KV-cache slot (and guided-decoding row owner) of the request.
    token_ids : list of int
        Tokens fed this step: a prompt chunk, or the last sampled token.
    start_position : int
        Absolute position of ``token_ids[0]`` (= tokens already cached).
    is_prefill : bool
        The tokens are prompt tokens.
    samples : bool
        The step's sample for this request is used (decode, or the last
        prompt chunk); a non-final prompt chunk's sample is discarded.
    num_draft_tokens : int
        Decode only: ``token_ids[1:]`` are draft tokens to verify
        (speculative decoding, :mod:`tpguide.speculative.verify`).
    """

    request: Request
    slot: int
    token_ids: List[int]
    start_position: int
    is_prefill: bool
    samples: bool
    num_draft_tokens: int = 0


class Scheduler:
    """FCFS continuous batching over ``max_num_seqs`` slots.

    Parameters
    ----------
    max_num_seqs : int
        KV-cache slots = requests running at once.
    max_num_batched_tokens : int
        Token budget of one step (prefill chunks are cut to fit).
    propose_drafts : callable, optional
        ``propose_drafts(request, budget) -> list of int``: draft tokens a
        decode step verifies after the last sampled token (at most
        ``budget - 1``); None disables speculative decoding.

    Raises
    ------
    ValueError
        If a limit is not positive.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int,
                 propose_drafts: Optional[Callable[[Request, int], List[int]]] = None) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs and max_num_batched_tokens must be >= 1, got "
                f"{max_num_seqs}, {max_num_batched_tokens}"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.propose_drafts = propose_drafts
        self.waiting: Deque[Request] = deque()
        self.running: Dict[int, Request] = {}
        self.free_slots: List[int] = list(range(max_num_seqs - 1, -1, -1))

    def add(self, request: Request) -> None:
        """Queue a request whose ``prompt_token_ids`` are set."""
        assert request.prompt_token_ids, "prompts are validated before scheduling"
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, request: Request) -> None:
        """Free the slot of a finished request (idempotent)."""
        slot = request.slot
        if slot is not None and self.running.get(slot) is request:
            del self.running[slot]
            self.free_slots.append(slot)

    def schedule(self) -> List[ScheduledRequest]:
        """Pick this step's work; admitted requests get a slot."""
        budget = self.max_num_batched_tokens
        seqs: List[ScheduledRequest] = []
        decoding = [slot for slot, req in self.running.items() if not req.is_prefill]
        for slot, req in sorted(self.running.items()):
            if budget == 0:
                break
            if not req.is_prefill:
                decoding.remove(slot)  # drafts never take the golden token of a later decode
                spare = budget - len(decoding)
                drafts = self.propose_drafts(req, spare) if self.propose_drafts and spare > 1 else []
                assert len(drafts) < max(spare, 1), (len(drafts), spare)
                seqs.append(ScheduledRequest(req, slot, [req.output_token_ids[-1]] + drafts,
                                         req.num_tokens - 1, False, True, len(drafts)))
                budget -= 1 + len(drafts)
        for slot, req in sorted(self.running.items()):
            if budget > 0 and req.is_prefill:
                budget -= self._prefill_chunk(req, slot, budget, seqs)
        while budget > 0 and self.waiting and self.free_slots:
            req = self.waiting.popleft()
            slot = self.free_slots.pop()
            req.slot = slot
            req.num_computed_tokens = 0
            self.running[slot] = req
            budget -= self._prefill_chunk(req, slot, budget, seqs)
        return seqs

    @staticmethod
    def _prefill_chunk(req: Request, slot: int, budget: int, seqs: List[ScheduledRequest]) -> int:
        start = req.num_computed_tokens
        end = min(len(req.prompt_token_ids), start + budget)
        seqs.append(ScheduledRequest(req, slot, req.prompt_token_ids[start:end], start, True,
                                 end == len(req.prompt_token_ids)))
        return end - start
