"""The driver: a request's life on rank 0, from admission to its outputs; the step phases it delegates.

:class:`Driver` owns the requests, the tokenizer, the scheduler, the grammar
matchers and the speculator.  :class:`~tpguide.engine.engine.Engine` calls,
per step::

    scheduled = driver.schedule_step()                # drafts proposed, then scheduled (engine/drafting.py)
    planned = driver.plan_step(scheduled, <draft-head drafts>)  # a PlannedStep value (engine/planner.py)
    filled  = driver.fill_bitmask(planned)            # in a thread, while the forward runs
    forward = runner.execute_model(planned.plan)      # every rank (tpguide/worker/runner.py)
    result  = runner.sample_tokens(planned.plan, forward, driver.bitmask_slices(filled, tp_size))
    outputs = driver.finish_step(planned, result, filled)       # StepFinisher (engine/finisher.py)

Everything here fails per request: a bad prompt, a grammar that does not
compile, a dead end or a matcher error finishes that request with
``finish_reason="error"`` and a message, and the rest of the batch goes on.

**Admission**, the ONE place where a request is checked before it runs.
:func:`admit_request` tokenizes the prompt (chat template for ``messages``),
checks its length against ``max_model_len`` (the sampling values are checked
when :class:`~tpguide.engine.request.SamplingParams` is built) and submits
the structured-output guide.  Any failure raises ``ValueError`` naming the
values; :meth:`Driver.add_request` turns it into ``finish_reason="error"``
for that request only.  Checks that refuse a
request up front (fail closed, docs/architecture.md §5) belong here.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from tpguide.engine.drafting import head_draft_requests, propose_drafts, with_head_drafts
from tpguide.engine.finisher import StepFinisher
from tpguide.engine.kv_cache_manager import KVCacheManager
from tpguide.engine.planner import PlannedStep, planned_step_of
from tpguide.engine.request import Request, RequestOutput
from tpguide.engine.scheduler import ScheduledRequest, Scheduler
from tpguide.guided import GuidedDecoder, make_backend, split_bitmask
from tpguide.guided.admission import admit
from tpguide.guided.compile_service import CompileService
from tpguide.guided.schema_check import validate_output
from tpguide.guided.thinking import Thinking
from tpguide.speculative.draft_loop import DraftRequest
from tpguide.speculative.verify import Speculator
from tpguide.worker.protocol import BitmaskSlices, StepResult


def tokenize_prompt(tokenizer, req: Request) -> List[int]:
    """Prompt token ids: chat template for ``messages``, plain encoding for ``prompt``.

    ``chat_template_kwargs`` become template variables (Qwen3's
    ``enable_thinking``).  A template that rejects the messages (Gemma 2:
    no system role) raises ``ValueError`` naming its reason: that request fails.
    """
    if req.messages is not None:
        from jinja2 import TemplateError

        try:
            text = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False,
                                                 **(req.chat_template_kwargs or {}))
        except TemplateError as exc:
            raise ValueError(f"the model's chat template rejected the messages: {exc}") from exc
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(req.prompt)["input_ids"])


def admit_request(req: Request, tokenizer, config, compile_guide: Callable, reasoning=None) -> None:
    """Prepare ``req`` to run: prompt ids, seed, compiled guide, whether it thinks.

    Parameters
    ----------
    req : Request
        Not finished.  On return ``prompt_token_ids`` and ``seed`` are set
        (``prompt_token_ids`` also when a later check fails, for the report).
    tokenizer : transformers tokenizer
    config : EngineConfig
        ``max_model_len`` and the run ``seed`` (a request without a seed uses
        ``seed * 1_000_003 + index``).
    compile_guide : callable
        ``compile_guide(StructuredOutputsParams)``: compiles (and caches) the
        guide; raises ``ValueError`` for one that does not compile.
    reasoning : ReasoningParser, optional
        The engine's (docs/reasoning.md); ``req.thinks`` is set unless the
        prompt closes the think block.

    Raises
    ------
    ValueError
        Empty prompt, prompt + ``max_tokens`` over ``max_model_len``, bad
        sampling values, a guide that does not compile, ``thinking_token_budget``
        without a reasoning parser (the message names the values).
    """
    if req.prompt is not None and not req.prompt.strip():
        raise ValueError(f"the prompt is empty or whitespace only: {req.prompt!r}")
    ids = tokenize_prompt(tokenizer, req)
    if not ids:
        raise ValueError("the prompt is empty (0 tokens)")
    req.prompt_token_ids = ids  # reported in the output even if a later check fails
    limit = config.max_model_len
    total = len(ids) + req.sampling_params.max_tokens
    if total > limit:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({req.sampling_params.max_tokens}) = "
            f"{total} exceeds max_model_len={limit}"
        )
    _check_stop_and_penalties(req, len(tokenizer), config)
    if reasoning is None and req.sampling_params.thinking_token_budget is not None:
        raise ValueError(f"thinking_token_budget={req.sampling_params.thinking_token_budget} needs a reasoning "
                         f"model (reasoning_parser={config.reasoning_parser!r} found no think tokens)")
    req.thinks = reasoning is not None and reasoning.starts_thinking(ids)
    if req.structured_output is not None:
        compile_guide(req.structured_output)
    if req.sampling_params.seed is not None:
        req.seed = req.sampling_params.seed
    else:
        req.seed = (config.seed * 1_000_003 + req.index) % (2**63 - 1)


def _check_stop_and_penalties(req: Request, tokenizer_vocab_size: int, config) -> None:
    """Refuse what could not be honoured: a stop string cutting a guided output, penalties with drafts.

    Grammar drafts skip a request with penalties (:meth:`Speculator.propose`);
    the n-gram and draft-head drafters would draft every request.
    """
    sp = req.sampling_params
    if sp.stop and req.structured_output is not None:
        raise ValueError(f"stop strings {list(sp.stop)} cannot be combined with structured_output: the output "
                         "cut at a stop string would not satisfy its guide")
    if sp.has_penalties and config.speculative_method in ("ngram", "draft-head"):
        raise ValueError("presence/frequency/repetition penalties and logit_bias are not supported with "
                         f"speculative decoding (speculative_method={config.speculative_method!r})")
    bad = [t for t, _ in sp.logit_bias if t >= tokenizer_vocab_size]
    if bad:
        raise ValueError(f"logit_bias token ids {bad} are outside the tokenizer's vocabulary "
                         f"[0, {tokenizer_vocab_size})")


#: JSON layouts of grammar drafts are compiled only for a guide admitted within this share of
#: ``grammar_compile_timeout_s`` (docs/architecture.md §5 "JSON layouts").
LAYOUT_COMPILE_BUDGET = 0.1


class Filled(NamedTuple):
    """One bitmask fill of the driver: full rows, which rows are guided, and the rows whose fill failed."""

    token_bitmask: torch.Tensor  # int32 [R, bitmask_size]
    token_mask: torch.Tensor  # int32 [R]; 0 on a failed row
    dead_end_rows: List[int]  # a dead end, or a matcher that raised: the request fails in finish_step


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
        self.guided: Optional[GuidedDecoder] = None  # built on the first guided request (takes a few seconds)
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
        self._compiles = CompileService(config.grammar_compile_timeout_s)  # guide checks + compile, off the loop
        self._arrivals: deque = deque()  # admitted, waiting for their guide to compile (FIFO into the scheduler)
        self._compiled: dict = {}  # request index -> (result, error) of its guide's admission

    @property
    def stop_token_ids(self) -> Set[int]:
        """Ids that end a request with ``"stop"`` (held by the step finisher, which checks them)."""
        return self.finisher.stop_token_ids

    @stop_token_ids.setter
    def stop_token_ids(self, ids) -> None:
        self.finisher.stop_token_ids = set(ids)

    # ------------------------------------------------------------ admission
    def guided_decoder(self) -> GuidedDecoder:
        """The matchers (built with the backend on first use)."""
        if self.guided is None:
            backend = make_backend(self.config.guided_backend, self.tokenizer, self.padded_vocab_size,
                                   sorted(self.stop_token_ids), json_whitespace=self.config.json_whitespace)
            self.guided = GuidedDecoder(backend, self.padded_vocab_size,  # 1 + K rows per request
                                        self.config.max_num_seqs * (1 + self.config.num_speculative_tokens))
        return self.guided

    def tokenize(self, req: Request) -> List[int]:
        """Prompt token ids of ``req`` (:func:`tokenize_prompt`)."""
        return tokenize_prompt(self.tokenizer, req)

    def add_request(self, req: Request) -> None:
        """Admit ``req`` (:func:`admit_request`) and queue it; never raises for bad input.

        A guide is checked (fail closed, :mod:`tpguide.guided.admission`) and
        compiled in a worker thread (:class:`~tpguide.guided.compile_service.CompileService`);
        requests join the scheduler in arrival order, each once its guide is
        admitted, while the running ones keep stepping.
        """
        if not req.is_finished:
            try:
                admit_request(req, self.tokenizer, self.config, self._submit_guide(req), self.reasoning)
                self._check_fits_kv_cache(req)
            except ValueError as exc:
                req.fail(str(exc))
        if req.is_finished:
            self._unreported.append(req)
        else:
            self._arrivals.append(req)
            self._admit_arrivals()

    def _check_fits_kv_cache(self, req: Request) -> None:
        """Refuse a request the KV pool could not hold even alone (ValueError naming the numbers)."""
        k = self.config.num_speculative_tokens
        what = (f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({req.sampling_params.max_tokens})"
                + (f" + {k} speculative lookahead" if k else ""))
        self.kv.check_fits(len(req.prompt_token_ids) + req.sampling_params.max_tokens + k, what)

    def _submit_guide(self, req: Request):
        def submit(params) -> None:
            backend = self.guided_decoder().backend
            drafter = self.spec.grammar_drafter if self.spec is not None else None
            timeout_s = self.config.grammar_compile_timeout_s or 60.0

            def job():
                start = time.perf_counter()
                admitted = admit(backend, params)
                # the grammar drafter's JSON layouts, compiled beside the guide where the guide itself was
                # quick (a layout compiles faster than its guide, so the four stay far inside the timeout)
                if drafter is not None and time.perf_counter() - start < LAYOUT_COMPILE_BUDGET * timeout_s:
                    drafter.prepare(backend, params)
                return admitted
            self._compiles.submit(req.index, job)
        return submit

    def wait_for_admissions(self) -> None:
        """Block until every added request's guide is admitted or refused (offline start: deterministic batches)."""
        while self._arrivals:
            self._compiles.wait()
            self._admit_arrivals()

    def _admit_arrivals(self, wait_s: float = 0.0) -> None:
        """Move the admitted prefix of the arrivals into the scheduler; refused guides fail their request.

        ``wait_s`` > 0: with nothing running, wait up to that long for a compile first.
        """
        if wait_s > 0 and self._arrivals and not self.scheduler.has_unfinished():
            self._compiles.wait(wait_s)
        waiting = {r.index for r in self._arrivals}  # results of aborted arrivals are dropped
        self._compiled.update((index, (result, error)) for index, result, error in self._compiles.collect()
                              if index in waiting)
        while self._arrivals and (self._arrivals[0].structured_output is None
                                  or self._arrivals[0].index in self._compiled):
            req = self._arrivals.popleft()
            result, error = self._compiled.pop(req.index, (None, None))
            if error is None:
                req.guided_backend = result[0] if result is not None else None
                self.scheduler.add(req)
            else:
                req.fail(str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}")
                self._unreported.append(req)

    def abort_request(self, request_id: str) -> None:
        """Finish ``request_id`` with ``"abort"`` at the next step boundary (unknown ids are ignored)."""
        self._aborts.append(str(request_id))

    def has_unfinished_requests(self) -> bool:
        """True while some added request has not had its final output returned."""
        return self.scheduler.has_unfinished() or bool(self._unreported) or bool(self._arrivals)

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
            for req in [r for r in self._arrivals if r.request_id in aborts]:
                req.finish("abort")  # its compile result is dropped when it arrives
                self._unreported.append(req)
            kept = [r for r in self._arrivals if not r.is_finished]
            self._arrivals.clear()
            self._arrivals.extend(kept)
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
                try:
                    self.guided_decoder().add_request(s.slot, req.structured_output, thinking)
                except ValueError as exc:
                    req.fail(str(exc))
        return scheduled

    def head_draft_requests(self, scheduled: List[ScheduledRequest]) -> List[DraftRequest]:
        """The draft-head drafting loop's requests of ``scheduled`` (:func:`~tpguide.engine.drafting.head_draft_requests`)."""
        return head_draft_requests(scheduled, self.guided)

    def plan_step(self, scheduled: List[ScheduledRequest],
                  head_drafts: Optional[List[List[int]]] = None) -> PlannedStep:
        """Plan the step of ``scheduled`` (:meth:`schedule_step`, not empty).

        Parameters
        ----------
        head_drafts : list of list of int, optional
            ``draft-head``: the drafting loop's drafts, one list per request of
            :meth:`head_draft_requests`, in its order.
        """
        self.num_steps += 1
        return planned_step_of(self.num_steps, with_head_drafts(scheduled, head_drafts))

    def fill_bitmask(self, planned: PlannedStep) -> Filled:
        """Fill the guided rows of ``planned`` (runs in a thread while the forward runs)."""
        token_bitmask, token_mask, failed = self.guided.fill_bitmask_with_drafts(planned.bitmask_entries())
        for row in failed:
            token_mask[row] = 0  # the fill already reset the row; the request fails in finish_step
        return Filled(token_bitmask, token_mask, list(failed))

    @staticmethod
    def bitmask_slices(filled: Filled, tp_size: int) -> BitmaskSlices:
        """``(token_mask, per-rank word slices)`` of a fill, for the scatter."""
        return BitmaskSlices(filled.token_mask, split_bitmask(filled.token_bitmask, tp_size))

    def finish_step(self, planned: PlannedStep, result: StepResult,
                    filled: Optional[Filled] = None) -> List[RequestOutput]:
        """Apply the step's result (:class:`StepFinisher`); the outputs of the requests that changed.

        ``filled``: the step's bitmask fill (:meth:`fill_bitmask`), None for an unguided step.
        """
        self.finisher.record_prompt_logprobs(planned, result)
        self.finisher.finish(planned, result, self.guided, filled.dead_end_rows if filled is not None else ())
        outputs = []
        for s in planned.scheduled:
            req = s.request
            if self.scheduler.holds_slot(req):
                self.kv.cache_final_blocks(req)  # full blocks of accepted tokens: reusable by later prefixes
            if req.is_finished:
                self._release(req)
            if req.is_finished or len(req.output_token_ids) > req.num_reported_tokens:
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

    # ------------------------------------------------------------ outputs
    def _texts(self, req: Request) -> Tuple[Optional[str], str]:
        """``(reasoning, text)`` of ``req`` now: the think block and the answer (docs/reasoning.md), or (None, all).

        A stop string's cut (an offset in the whole output's text) cuts the answer, the reasoning kept whole.
        """
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""  # noqa: E731
        ids = req.output_token_ids
        reasoning, answer = (None, ids) if not req.thinks else self.reasoning.split(ids)
        text = decode(answer or [])
        if req.stop_text_cut is not None:  # finished at a stop string: the text ends before it
            before = len(decode(ids)) - len(text)  # the whole output's text up to the answer
            text = text[:max(0, req.stop_text_cut - before)]
        return (decode(reasoning) if reasoning is not None else None), text

    def output_of(self, req: Request) -> RequestOutput:
        """``req``'s output now: the delta since the last report plus the totals."""
        ids = req.output_token_ids
        start = req.num_reported_tokens
        req.num_reported_tokens = len(ids)
        reasoning, text = self._texts(req)
        if req.finish_reason == "stop" and req.structured_output is not None:
            invalid = validate_output(req.structured_output, text)  # the last line of defence (fail closed)
            if invalid is not None:
                req.finish_reason, req.error = "error", invalid
        elapsed = (req.finish_time or time.perf_counter()) - req.arrival_time
        want_logprobs = bool(req.sampling_params.logprobs)
        return RequestOutput(
            request_id=req.request_id, index=req.index,
            new_token_ids=list(ids[start:]), token_ids=list(ids), text=text, reasoning=reasoning,
            finish_reason=req.finish_reason, error=req.error,
            num_prompt_tokens=len(req.prompt_token_ids),
            new_logprobs=list(req.output_logprobs[start:]) if want_logprobs else None,
            logprobs=list(req.output_logprobs) if want_logprobs else None,
            prompt_logprobs=([None] + req.prompt_logprobs
                             if req.sampling_params.prompt_logprobs is not None and req.prompt_token_ids
                             and req.finish_reason != "error"
                             else None),
            elapsed_s=elapsed, guided_backend=req.guided_backend,
        )
