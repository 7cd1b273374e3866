"""The driver: the step phases of rank 0 around the requests it holds (schedule, plan, fill, finish, release).

:class:`Driver` owns the requests' scheduler, the grammar matchers and the
speculator; requests reach it through :class:`~tpguide.engine.intake.Intake`
(every check before a request runs) and leave it as outputs
(:func:`~tpguide.engine.outputs.request_output`).
:class:`~tpguide.engine.engine.Engine` calls, per step::

    scheduled = driver.schedule_step()           # drafts proposed, then scheduled (engine/drafting.py)
    step      = driver.plan_step(scheduled, <draft-head drafts>)  # a ScheduledStep (engine/planner.py)
    fill      = driver.fill_bitmask(step)        # a BitmaskFill, in a thread, while the forward runs
    forward   = runner.execute_model(step.plan)  # every rank (tpguide/worker/runner.py)
    result    = runner.sample_tokens(step.plan, forward, driver.bitmask_slices(fill, tp_size))
    outputs   = driver.finish_step(step, result, fill)  # StepFinisher (engine/finisher.py)

Everything here fails per request: a dead end or a matcher error finishes
that request with ``finish_reason="error"`` and a message, and the rest of
the batch goes on.
"""

from __future__ import annotations

from collections import deque
from typing import FrozenSet, List, NamedTuple, Optional, Sequence, Set

import torch

from tpguide.engine.drafting import head_draft_requests, propose_drafts, with_head_drafts
from tpguide.engine.finisher import StepFinisher
from tpguide.engine.intake import Intake, tokenize_prompt
from tpguide.engine.kv_cache_manager import KVCacheManager
from tpguide.engine.outputs import failed_output, request_output
from tpguide.engine.planner import ScheduledStep, scheduled_step_of
from tpguide.engine.receipt import ReceiptContext, build_receipt, request_line
from tpguide.engine.request import Request, RequestOutput
from tpguide.engine.request_faults import contained, inject_fault
from tpguide.engine.scheduler import ScheduledRequest, Scheduler
from tpguide.guided import GuidedDecoder, make_backend, split_bitmask
from tpguide.guided.bitmask import find_single_token_rows
from tpguide.guided.thinking import Thinking
from tpguide.speculative.draft_loop import DraftRequest
from tpguide.speculative.propose import Speculator
from tpguide.worker.protocol import BitmaskSlices, StepResult


class BitmaskFill(NamedTuple):
    """One step's bitmask fill on the driver: full rows, which rows are guided, and the rows whose fill failed."""

    token_bitmask: torch.Tensor  # int32 [R, bitmask_size]
    token_mask: torch.Tensor  # int32 [R]; 0 on a failed row
    dead_end_rows: List[int]  # a dead end, or a matcher that raised: the request fails in finish_step
    forced_rows: FrozenSet[int] = frozenset()  # rows that allow one token id (the receipts' forced_tokens)


class KVCacheStats(NamedTuple):
    """The KV pool and prefix cache (blocks; tokens for the prefix counters and prefill)."""

    num_blocks: int
    num_used_blocks: int  # referenced by a running request
    num_cached_blocks: int  # holding a prefix key (in use or evictable)
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    num_prefill_tokens: int  # prompt (and recomputed) tokens computed


class Driver:
    """Requests, scheduler, matchers and outputs of one engine (driver rank only).

    Parameters
    ----------
    tokenizer : transformers tokenizer
    stop_token_ids : sequence of int
        Ids that end a request with ``finish_reason="stop"``.
    padded_vocab_size : int
        Bitmask width in tokens.
    config : EngineConfig
    num_kv_blocks : int
        Blocks in the ranks' KV pool (``config.block_size`` tokens each).
    reasoning : ReasoningParser, optional
        The think-block tokens (:func:`tpguide.guided.reasoning.resolve_reasoning_parser`); None: off.
    """

    def __init__(self, tokenizer, stop_token_ids: Sequence[int], padded_vocab_size: int, config,
                 num_kv_blocks: int, reasoning=None) -> None:
        self.tokenizer = tokenizer
        self.reasoning = reasoning
        self.config = config
        self.padded_vocab_size = padded_vocab_size
        self.guided: Optional[GuidedDecoder] = None  # built by guided_decoder(), at start-up (engine/startup.py)
        self.spec: Optional[Speculator] = None  # drafting and verification, with speculative decoding
        if config.speculative_method is not None:
            grammar = None
            if config.grammar_draft:
                from tpguide.speculative.grammar_draft import GrammarDrafter

                grammar = GrammarDrafter(tokenizer, padded_vocab_size)
            self.spec = Speculator(config.speculative_method, config.num_speculative_tokens, config.max_model_len,
                                   grammar_drafter=grammar)
        self.kv = KVCacheManager(num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, kv=self.kv)
        self.finisher = StepFinisher(set(stop_token_ids), config.max_model_len, self.spec,
                                     detokenize=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True))
        self.num_steps = 0
        self._unreported: deque = deque()  # finished outside a step (admission errors, aborts)
        self._aborts: List[str] = []
        self.intake = Intake(tokenizer, config, self.kv, reasoning)
        #: the constant part of every receipt (set by :func:`~tpguide.engine.startup.build_engine`); None: no receipts
        self.receipts: Optional[ReceiptContext] = None

    @property
    def stop_token_ids(self) -> Set[int]:
        """Ids that end a request with ``"stop"`` (held by the step finisher, which checks them)."""
        return self.finisher.stop_token_ids

    @stop_token_ids.setter
    def stop_token_ids(self, ids) -> None:
        self.finisher.stop_token_ids = set(ids)

    # ------------------------------------------------------------ admission
    def guided_decoder(self) -> GuidedDecoder:
        """The matchers and their backend: built on the first call, which engine start-up makes
        (:func:`~tpguide.engine.startup.start_engine`, in its grammar-tables thread: a few seconds)."""
        if self.guided is None:
            backend = make_backend(self.config.guided_backend, self.tokenizer, self.padded_vocab_size,
                                   sorted(self.stop_token_ids), json_whitespace=self.config.json_whitespace)
            self.guided = GuidedDecoder(backend, self.padded_vocab_size,  # 1 + K rows per request
                                        self.config.max_num_seqs * (1 + self.config.num_speculative_tokens))
        return self.guided

    def tokenize(self, req: Request) -> List[int]:
        """Prompt token ids of ``req`` (:func:`~tpguide.engine.intake.tokenize_prompt`)."""
        return tokenize_prompt(self.tokenizer, req)

    def add_request(self, req: Request) -> None:
        """Check ``req`` and queue it (:class:`~tpguide.engine.intake.Intake`); never raises for bad input.

        A guide is checked (fail closed, :mod:`tpguide.guided.admission`) and
        compiled in a worker thread; requests join the scheduler in arrival
        order, each once its guide is admitted, while the running ones keep
        stepping.
        """
        if not req.is_finished:
            guided = req.structured_output is not None
            self.intake.add(req, backend=self.guided_decoder().backend if guided else None,
                            drafter=self.spec.grammar_drafter if guided and self.spec is not None else None)
        if req.is_finished:
            self._unreported.append(req)
        else:
            self._admit_arrivals()

    def wait_for_admissions(self) -> None:
        """Block until every added request's guide is admitted or refused (offline start: deterministic batches)."""
        while self.intake.has_arrivals():
            self.intake.wait()
            self._admit_arrivals()

    def _admit_arrivals(self, wait_s: float = 0.0) -> None:
        """Move the admitted arrivals into the scheduler; refused ones are reported.

        ``wait_s`` > 0: with nothing running, wait up to that long for a compile first.
        """
        if wait_s > 0 and self.intake.has_arrivals() and not self.scheduler.has_unfinished():
            self.intake.wait(wait_s)
        admitted, refused = self.intake.take_admitted()
        for req in admitted:
            self.scheduler.add(req)
        self._unreported.extend(refused)

    def abort_request(self, request_id: str) -> None:
        """Finish ``request_id`` with ``"abort"`` at the next step boundary (unknown ids are ignored)."""
        self._aborts.append(str(request_id))

    def has_unfinished_requests(self) -> bool:
        """True while some added request has not had its final output returned."""
        return self.scheduler.has_unfinished() or bool(self._unreported) or self.intake.has_arrivals()

    def has_work(self) -> bool:
        """True when the next step runs the model (some request is waiting or running)."""
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------ step boundary
    def take_finished_outside_steps(self) -> List[RequestOutput]:
        """Admit compiled arrivals, apply pending aborts; final outputs of requests that finished outside a step.

        With nothing running and guides still compiling, waits a little
        (50 ms) for them: no collective is made while waiting.
        """
        self._admit_arrivals(wait_s=0.05)
        aborts, self._aborts = set(self._aborts), []
        if aborts:
            self._unreported.extend(self.intake.abort(aborts))  # their compile results are dropped
            waiting = self.scheduler.waiting
            for req in [r for r in waiting if r.request_id in aborts]:
                req.finish("abort")
                self._unreported.append(req)
            kept = [r for r in waiting if not r.is_finished]
            waiting.clear()
            waiting.extend(kept)
            holding = list(self.scheduler.running.values()) + list(self.scheduler.preempted)
            for req in [r for r in holding if r.request_id in aborts and not r.is_finished]:
                req.finish("abort")
                self._release(req)  # slot, bitmask row, matcher and KV blocks (cached ones stay reusable)
                self._unreported.append(req)
        outputs = [self.output_of(req) for req in self._unreported]
        self._unreported.clear()
        return outputs

    # ------------------------------------------------------------ the step
    def schedule_step(self) -> List[ScheduledRequest]:
        """The drafting phase, then the scheduler: the next step's requests (maybe none).

        Every decoding request's drafts are proposed first (:mod:`tpguide.engine.drafting`)
        and handed to the scheduler as values; a request that got its slot
        this step gets a fresh matcher.  ``draft-head`` drafts are placeholders
        until the drafting loop (:meth:`head_draft_requests`, :meth:`plan_step`).
        """
        drafts = None
        if self.spec is not None:
            drafts = propose_drafts(self.spec, self.guided, self.scheduler.decoding(),
                                    self.config.max_num_batched_tokens)
        scheduled = self.scheduler.schedule(drafts)
        for s in scheduled:
            req = s.request
            if s.is_new and req.has_grammar_state:  # from the prompt's end, cached prefix or not
                thinking = (Thinking(self.reasoning.end_token_id, req.sampling_params.thinking_token_budget)
                            if req.thinks else None)
                with contained(req, "schedule"):
                    try:
                        self.guided_decoder().add_request(s.slot, req.structured_output, thinking,
                                                          compiled=req.compiled_guide)
                    except ValueError as exc:
                        req.fail(str(exc))
            inject_fault(req, "step")  # tests: a fault of the step itself, outside any request's containment
        return scheduled

    def head_draft_requests(self, scheduled: List[ScheduledRequest]) -> List[DraftRequest]:
        """The draft-head drafting loop's requests of ``scheduled`` (:func:`~tpguide.engine.drafting.head_draft_requests`)."""
        return head_draft_requests(scheduled, self.guided)

    def plan_step(self, scheduled: List[ScheduledRequest],
                  head_drafts: Optional[List[List[int]]] = None) -> ScheduledStep:
        """Plan the step of ``scheduled`` (:meth:`schedule_step`, not empty).

        Parameters
        ----------
        head_drafts : list of list of int, optional
            ``draft-head``: the drafting loop's drafts, one list per request of
            :meth:`head_draft_requests`, in its order.
        """
        self.num_steps += 1
        return scheduled_step_of(self.num_steps, with_head_drafts(scheduled, head_drafts))

    def fill_bitmask(self, scheduled_step: ScheduledStep) -> BitmaskFill:
        """Fill the guided rows of ``scheduled_step`` (runs in a thread while the forward runs)."""
        token_bitmask, token_mask, failed = self.guided.fill_bitmask_with_drafts(scheduled_step.bitmask_entries())
        for row in failed:
            token_mask[row] = 0  # the fill already reset the row; the request fails in finish_step
        forced = find_single_token_rows(token_bitmask, token_mask)
        return BitmaskFill(token_bitmask, token_mask, list(failed), frozenset(forced))

    @staticmethod
    def bitmask_slices(fill: BitmaskFill, tp_size: int) -> BitmaskSlices:
        """``(token_mask, per-rank word slices)`` of a fill, for the scatter."""
        return BitmaskSlices(fill.token_mask, split_bitmask(fill.token_bitmask, tp_size))

    def finish_step(self, scheduled_step: ScheduledStep, result: StepResult,
                    fill: Optional[BitmaskFill] = None, finished_only: bool = False) -> List[RequestOutput]:
        """Apply the step's result (:class:`StepFinisher`); the outputs of the requests that changed.

        ``fill``: the step's bitmask fill (:meth:`fill_bitmask`), None for an unguided step.
        ``finished_only``: only the finished requests' outputs; a running
        request's new tokens are marked reported without an output
        (:meth:`~tpguide.engine.engine.Engine.step`).
        """
        self.finisher.record_prompt_logprobs(scheduled_step, result)
        dead_end_rows, forced_rows = (fill.dead_end_rows, fill.forced_rows) if fill is not None else ((), frozenset())
        self.finisher.finish(scheduled_step, result, self.guided, dead_end_rows, forced_rows)
        outputs = []
        for s in scheduled_step.scheduled:
            req = s.request
            if self.scheduler.holds_slot(req):
                self.kv.cache_final_blocks(req)  # full blocks of accepted tokens: reusable by later prefixes
            if req.is_finished:
                self._release(req)
            if req.is_finished:
                outputs.append(self.output_of(req))
            elif len(req.output_token_ids) > req.num_reported_tokens:
                if finished_only:  # nobody reads it: the delta is passed over, the final output starts after it
                    req.num_reported_tokens = len(req.output_token_ids)
                else:
                    outputs.append(self.output_of(req))
        return outputs

    def _release(self, req: Request) -> None:
        """Free the slot, bitmask row, matcher and KV blocks of a finished request (idempotent)."""
        if self.scheduler.holds_slot(req):
            if self.guided is not None:
                self.guided.remove_request(req.slot)
            self.scheduler.release(req)

    def kv_cache_stats(self) -> "KVCacheStats":
        """The KV pool and prefix cache now (counters since the engine started)."""
        pool = self.kv.pool
        return KVCacheStats(num_blocks=pool.num_blocks, num_used_blocks=pool.num_used,
                            num_cached_blocks=len(pool.cached), prefix_cache_queries=self.kv.prefix_queries,
                            prefix_cache_hits=self.kv.prefix_hits, num_preemptions=self.scheduler.num_preemptions,
                            num_prefill_tokens=self.scheduler.num_prefill_tokens)

    def output_of(self, req: Request) -> RequestOutput:
        """``req``'s output now (:func:`~tpguide.engine.outputs.request_output`): the delta since the last report.

        An exception while building it fails ``req`` alone (:func:`~tpguide.engine.request_faults.contained`)
        and reports it without text.
        """
        out = None
        with contained(req, "output"):
            out = request_output(req, self.tokenizer, self.reasoning)
            if out.finished and self.receipts is not None and (req.prompt is not None or req.messages is not None):
                out.request = request_line(req)  # a line that failed to parse has no request to replay
                out.receipt = build_receipt(req, out, self.receipts, self.reasoning)
        if out is None or out.finish_reason != req.finish_reason:  # it raised (or a fault came after it)
            return failed_output(req)
        return out
