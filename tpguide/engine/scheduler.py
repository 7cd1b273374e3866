"""Continuous batching with a token budget, chunked prefill, KV blocks and preemption (driver only).

docs/architecture.md §7 "KV cache".  Each step the scheduler packs, in this
order, until ``max_num_batched_tokens`` is spent: one decode token (plus
drafts) for every running request past its prompt, the next chunk of every
running request still in its prompt, then preempted requests to recompute,
then new requests admitted into free request slots (their first chunk,
after the longest cached prefix).  Every scheduled request first gets the
KV blocks its new tokens (and draft lookahead) need
(:class:`~tpguide.engine.kv_cache_manager.KVCacheManager`).

**Preemption by recompute.**  When the pool is short for a running request,
the newest running request (latest ``admit_order``) is preempted: its blocks
are freed (its full final blocks stay in the prefix cache), it keeps its
slot, matcher and output tokens, and it later recomputes every token it has
as one prefill (``Request.num_prefill_tokens``) whose last sample is its next
token.  Sampling is keyed by (seed, position), and in the TP-invariant mode
a row's logits do not depend on its batch or chunking, so the output is the
one an uninterrupted run gives.  New requests are not admitted while a
preempted one waits.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass
from operator import attrgetter
from typing import Deque, Dict, List, Optional

from tpguide.engine.kv_cache_manager import KVCacheManager
from tpguide.engine.request import Request

_admit_order = attrgetter("admit_order")  # oldest first


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes
    ----------
    request : Request
    slot : int
        Request slot: the guided-decoding row owner (its KV blocks are ``request.block_ids``).
    token_ids : list of int
        Tokens fed this step: a prompt chunk (or recomputed tokens), or the last sampled token.
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
    is_new : bool
        The request got its slot this step (a fresh matcher starts here); a
        cached prefix may make its ``start_position`` > 0.
    """

    request: Request
    slot: int
    token_ids: List[int]
    start_position: int
    is_prefill: bool
    samples: bool
    num_draft_tokens: int = 0
    is_new: bool = False


class Scheduler:
    """FCFS continuous batching over ``max_num_seqs`` request slots and a KV block pool.

    Parameters
    ----------
    max_num_seqs : int
        Request slots = requests running (or preempted) at once.
    max_num_batched_tokens : int
        Token budget of one step (prefill chunks are cut to fit).
    kv : KVCacheManager, optional
        The block pool; default: ``max_num_seqs`` blocks of ``2**30`` tokens,
        one per request, prefix caching off (the scheduler alone, in tests).

    Attributes
    ----------
    num_preemptions : int
        Requests preempted so far.
    num_prefill_tokens : int
        Prompt (and recomputed) tokens scheduled so far: a cached prefix is not counted.

    Raises
    ------
    ValueError
        If a limit is not positive.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int,
                 kv: Optional[KVCacheManager] = None) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs and max_num_batched_tokens must be >= 1, got "
                f"{max_num_seqs}, {max_num_batched_tokens}"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv = kv if kv is not None else KVCacheManager(max_num_seqs, 1 << 30, enable_prefix_caching=False)
        self.waiting: Deque[Request] = deque()
        self.running: Dict[int, Request] = {}
        self.preempted: List[Request] = []  # hold their slot; resumed oldest first
        self.free_slots: List[int] = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self.num_prefill_tokens = 0
        self._num_admitted = 0

    def add(self, request: Request) -> None:
        """Queue a request whose ``prompt_token_ids`` are set."""
        assert request.prompt_token_ids, "prompts are validated before scheduling"
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.preempted)

    def holds_slot(self, request: Request) -> bool:
        """True while ``request`` runs or waits preempted (it owns its slot)."""
        slot = request.slot
        return slot is not None and (self.running.get(slot) is request or request in self.preempted)

    def release(self, request: Request) -> None:
        """Free the slot and KV blocks of a finished request (idempotent)."""
        if self.holds_slot(request):
            self.running.pop(request.slot, None)
            if request in self.preempted:
                self.preempted.remove(request)
            self.free_slots.append(request.slot)
            self.kv.free(request)

    def decoding(self) -> List[Request]:
        """The running requests past their prompt, oldest first: those a step decodes (and may draft for)."""
        return [r for r in sorted(self.running.values(), key=_admit_order) if not r.is_prefill]

    def schedule(self, drafts: Optional[Dict[int, List[int]]] = None) -> List[ScheduledRequest]:
        """Pick this step's work; admitted requests get a slot, every scheduled one its KV blocks.

        Parameters
        ----------
        drafts : dict of int to list of int, optional
            Per slot of a decoding request: the draft tokens proposed for it
            (the drafting phase, docs/architecture.md §1), verified after its
            last sampled token.  Each keeps the prefix the token budget allows
            once every later decode has its golden token.
        """
        drafts = drafts or {}
        seqs = _StepSeqs()
        order = sorted(self.running.values(), key=_admit_order)  # oldest first
        decoding = [r for r in order if not r.is_prefill]  # self.decoding(), from the same sort
        preempted_before = self.num_preemptions
        for i, req in enumerate(decoding):
            budget = self.max_num_batched_tokens - seqs.num_tokens
            if budget == 0:
                break
            if self.running.get(req.slot) is not req:
                continue  # preempted by an older request this step
            spare = budget - (len(decoding) - 1 - i)  # drafts never take the golden token of a later decode
            kept = list(drafts.get(req.slot, ()))[:max(spare - 1, 0)]
            num_tokens = req.num_tokens
            if self._allocate_or_preempt(req, num_tokens + len(kept), seqs):
                seqs.append(ScheduledRequest(req, req.slot, [req.output_token_ids[-1]] + kept,
                                             num_tokens - 1, False, True, len(kept)))
        for req in order:
            budget = self.max_num_batched_tokens - seqs.num_tokens
            if budget > 0 and req.is_prefill and self.running.get(req.slot) is req:
                end = min(req.prefill_len, req.num_computed_tokens + budget)
                if self._allocate_or_preempt(req, end, seqs):
                    seqs.append(self._chunk(req, end))
        if self.num_preemptions == preempted_before:  # the pool is not short: resume, then admit
            self._resume_and_admit(seqs)
        self.num_prefill_tokens += sum(len(s.token_ids) for s in seqs if s.is_prefill)
        return list(seqs)

    def _resume_and_admit(self, seqs: "_StepSeqs") -> None:
        while self.max_num_batched_tokens - seqs.num_tokens > 0 and (self.preempted or (self.waiting and self.free_slots)):
            resume = bool(self.preempted)
            req = self.preempted[0] if resume else self.waiting[0]
            blocks, cached = self.kv.cached_prefix(req, req.prefill_len)
            end = min(req.prefill_len, cached + self.max_num_batched_tokens - seqs.num_tokens)
            if not self.kv.allocate(req, end, blocks):
                return  # the pool is short: try again next step
            self.kv.record_lookup(req.prefill_len, cached)
            if resume:
                self.preempted.pop(0)
            else:
                self.waiting.popleft()
                req.slot = self.free_slots.pop()
                req.admit_order = self._num_admitted
                self._num_admitted += 1
            req.num_computed_tokens = cached
            self.running[req.slot] = req
            seqs.append(self._chunk(req, end, is_new=not resume))

    def _allocate_or_preempt(self, req: Request, num_tokens: int, seqs: "_StepSeqs") -> bool:
        """Blocks for ``num_tokens`` positions of ``req``, preempting the newest requests; False if ``req`` itself went."""
        while not self.kv.allocate(req, num_tokens):
            victim = max(self.running.values(), key=_admit_order)
            self._preempt(victim, seqs)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, seqs: "_StepSeqs") -> None:
        """Free ``req``'s blocks and queue it for recompute; drop its share of this step if scheduled."""
        seqs.drop(req)
        freed = len(req.block_ids)
        self.kv.free(req)
        del self.running[req.slot]
        if req.output_token_ids:
            req.num_prefill_tokens = req.num_tokens  # recompute every token; the last sample is the next token
        else:
            req.num_prefill_tokens = None
            req.prompt_logprobs.clear()  # recomputed with the prompt
        req.num_computed_tokens = 0
        self.preempted.append(req)
        self.preempted.sort(key=_admit_order)
        self.num_preemptions += 1
        print(f"[rank 0] KV cache full: preempted request {req.request_id!r} ({req.num_tokens} tokens, {freed} "
              f"blocks freed; {self.kv.pool.num_free} of {self.kv.num_blocks} free); it will be recomputed",
              file=sys.stderr, flush=True)

    @staticmethod
    def _chunk(req: Request, end: int, is_new: bool = False) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(req, req.slot, req.all_token_ids[start:end], start, True, end == req.prefill_len,
                                is_new=is_new)


class _StepSeqs(list):
    """A step's scheduled requests so far and their token count (kept, not summed at every budget check)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_tokens = 0

    def append(self, s: ScheduledRequest) -> None:
        super().append(s)
        self.num_tokens += len(s.token_ids)

    def drop(self, req: Request) -> None:
        """Remove ``req``'s entry (a preemption)."""
        self[:] = [s for s in self if s.request is not req]
        self.num_tokens = sum(len(s.token_ids) for s in self)
