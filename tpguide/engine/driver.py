"""The driver: admission, the three step phases (plan, fill the bitmask, finish) and outputs (tp_rank 0 only).

:class:`Driver` owns the requests, the tokenizer, the scheduler, the grammar
matchers and the speculator.  :class:`~tpguide.engine.engine.Engine` calls,
per step::

    planned = driver.plan_step(...)          # a PlannedStep value
    filled  = driver.fill_bitmask(planned)   # in a thread, while the forward runs
    result  = runner.execute(planned.plan, <the filled rows>)   # every rank (tpguide/worker/runner.py)
    outputs = driver.finish_step(planned, result)               # StepFinisher

Everything here fails per request: a bad prompt, a grammar that does not
compile, a dead end or a matcher error finishes that request with
``finish_reason="error"`` and a message, and the rest of the batch goes on.

The file holds, in order: admission (:func:`admit_request`), planning
(:class:`PlannedStep`, :func:`plan_step`), finishing (:class:`StepFinisher`)
and the :class:`Driver` that runs them.

**Admission**, the ONE place where a request is checked before it runs.
:func:`admit_request` tokenizes the prompt (chat template for ``messages``),
checks its length against ``max_model_len`` (the sampling values are checked
when :class:`~tpguide.engine.request.SamplingParams` is built) and submits
the structured-output guide.  Any failure raises ``ValueError`` naming the
values; :meth:`Driver.add_request` turns it into ``finish_reason="error"``
for that request only.  Checks that refuse a
request up front (fail closed, docs/architecture.md §5) belong here.

**Planning**: the scheduler's choice becomes a :class:`PlannedStep` value.
A planned step holds everything the step needs: the :class:`StepPlan`
broadcast to every rank, and the driver's own bookkeeping (which request
owns which sample row, which rows are guided, where each request's prompt
logprob rows are).  The driver finishes the step from this value and the
ranks' :class:`~tpguide.worker.protocol.StepResult` (:class:`StepFinisher`);
nothing travels through fields that one caller sets and another reads.

**Finishing**: (planned step, step result) -> appended tokens, finished
requests, once per step.  In order:

1. guided rows whose bitmask fill failed (a dead end, or a matcher that
   raised, each with its own reason) fail their request;
2. every scheduled request advances ``num_computed_tokens``; a request whose
   sample is used gets its token (plain decode) or its verified window
   (speculative: ``d_1 .. d_a, y_a`` from :meth:`Speculator.verify`, the
   matcher rolled back to the accepted state);
3. each appended token is checked for the stop conditions, in this order:
   grammar (the matcher rejects it, or is terminated after it: ``"stop"``),
   stop token (unless ``ignore_eos``), stop string (:mod:`tpguide.engine.stop_strings`),
   ``max_tokens``, ``max_model_len``.

:meth:`StepFinisher.finish_stop` is the one place where a request finishes
with ``"stop"``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Set, Tuple

import torch

from tpguide.engine.request import Request, RequestOutput
from tpguide.engine.scheduler import ScheduledRequest, Scheduler
from tpguide.engine.stop_strings import find_stop_string
from tpguide.guided import GuidedDecoder, make_backend, split_bitmask
from tpguide.guided.admission import CompileService, admit
from tpguide.guided.schema_check import validate_output
from tpguide.guided.spec_counters import SpecAccountingError
from tpguide.sampling.penalties import build_logit_penalties
from tpguide.sampling.sampler import SamplingMetadata
from tpguide.sampling.sampler_inputs import ScheduledSeq, prepare_sampler_inputs
from tpguide.speculative.draft_loop import DraftRequest
from tpguide.speculative.verify import Speculator
from tpguide.worker.protocol import StepPlan, StepResult

# ---------------------------------------------------------------------- admission

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


def admit_request(req: Request, tokenizer, config, compile_guide: Callable) -> None:
    """Prepare ``req`` to run: prompt ids, seed, compiled guide.

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

    Raises
    ------
    ValueError
        Empty prompt, prompt + ``max_tokens`` over ``max_model_len``, bad
        sampling values, a guide that does not compile (the message names
        the values).
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
    if req.structured_output is not None:
        compile_guide(req.structured_output)
    if req.sampling_params.seed is not None:
        req.seed = req.sampling_params.seed
    else:
        req.seed = (config.seed * 1_000_003 + req.index) % (2**63 - 1)


def _check_stop_and_penalties(req: Request, tokenizer_vocab_size: int, config) -> None:
    """Refuse what could not be honoured: a stop string cutting a guided output, penalties with drafts."""
    sp = req.sampling_params
    if sp.stop and req.structured_output is not None:
        raise ValueError(f"stop strings {list(sp.stop)} cannot be combined with structured_output: the output "
                         "cut at a stop string would not satisfy its guide")
    if sp.has_penalties and config.speculative_method is not None:
        raise ValueError("presence/frequency/repetition penalties and logit_bias are not supported with "
                         f"speculative decoding (speculative_method={config.speculative_method!r})")
    bad = [t for t, _ in sp.logit_bias if t >= tokenizer_vocab_size]
    if bad:
        raise ValueError(f"logit_bias token ids {bad} are outside the tokenizer's vocabulary "
                         f"[0, {tokenizer_vocab_size})")


# ---------------------------------------------------------------------- planning

@dataclass(frozen=True)
class PlannedStep:
    """One step as planned on the driver.

    Attributes
    ----------
    number : int
        1 for the engine's first step (error messages say "at step N").
    plan : StepPlan
        What every rank executes.
    scheduled : list of ScheduledRequest
        The requests of the step, in batch order.
    first_rows : list of int
        ``[len(scheduled) + 1]``: request ``i`` owns sample rows
        ``first_rows[i] .. first_rows[i + 1] - 1`` (``1 + num_draft_tokens`` rows).
    guided_slots : list of int or None
        Per request: the slot whose matcher masks its rows this step, None for
        an unguided row (or one whose sample is discarded).
    prompt_row_offsets : list of int or None
        ``[len(scheduled) + 1]``: request ``i`` owns prompt-logprob rows
        ``[off[i], off[i + 1])``; None when no request asks for them.
    """

    number: int
    plan: StepPlan
    scheduled: List[ScheduledRequest]
    first_rows: List[int]
    guided_slots: List[Optional[int]]
    prompt_row_offsets: Optional[List[int]] = None

    def bitmask_entries(self) -> List[Tuple[Optional[int], List[int]]]:
        """``(slot or None, drafts)`` per request, the input of the speculative bitmask fill."""
        return [(slot, s.token_ids[1:1 + s.num_draft_tokens]) for slot, s in zip(self.guided_slots, self.scheduled)]

    def owner_of_row(self, row: int) -> ScheduledRequest:
        """The scheduled request that owns sample row ``row``."""
        for i, s in enumerate(self.scheduled):
            if self.first_rows[i] <= row < self.first_rows[i + 1]:
                return s
        raise IndexError(f"sample row {row} out of range [0, {self.first_rows[-1]})")


def planned_step_of(number: int, scheduled: Sequence[ScheduledRequest]) -> PlannedStep:
    """The :class:`PlannedStep` of ``scheduled`` (their drafts already filled in).

    A request is guided this step when its sample is used and it has a
    structured output and is not finished (a request that failed at
    scheduling keeps its rows, unguided, and its sample is discarded).
    """
    scheduled = list(scheduled)
    guided_slots = [
        s.slot if (s.samples and s.request.structured_output is not None and not s.request.is_finished) else None
        for s in scheduled
    ]
    first_rows = [0]
    for s in scheduled:
        first_rows.append(first_rows[-1] + 1 + s.num_draft_tokens)
    plan, prompt_row_offsets = build_step_plan(scheduled, guided=any(r is not None for r in guided_slots))
    return PlannedStep(number, plan, scheduled, first_rows, guided_slots, prompt_row_offsets)


def build_step_plan(scheduled: List[ScheduledRequest], guided: bool) -> Tuple[StepPlan, Optional[List[int]]]:
    """Flatten the scheduled requests into a :class:`StepPlan` and the prompt-logprob row offsets.

    Every scheduled request contributes ``1 + num_draft_tokens`` sample rows (docs/architecture.md §4: a
    non-final prefill chunk's row is computed and its sample discarded).
    """
    seqs = [
        ScheduledSeq(
            query_len=len(s.token_ids),
            num_computed_tokens=s.start_position,
            prompt_len=len(s.request.prompt_token_ids),
            is_prefill=s.is_prefill,
            is_last_prefill_chunk=s.is_prefill and s.samples,
            num_draft_tokens=s.num_draft_tokens,
            want_prompt_logprobs=s.request.sampling_params.prompt_logprobs is not None,
        )
        for s in scheduled
    ]
    inputs = prepare_sampler_inputs(seqs)
    input_ids: List[int] = []
    for s in scheduled:
        input_ids.extend(s.token_ids)
    params = [s.request.sampling_params for s in scheduled]
    rows = inputs.sample_row_to_seq.tolist()
    sampling = SamplingMetadata(
        temperature=torch.tensor([params[i].temperature for i in rows], dtype=torch.float32),
        top_k=torch.tensor([params[i].top_k for i in rows], dtype=torch.int32),
        top_p=torch.tensor([params[i].top_p for i in rows], dtype=torch.float32),
        seeds=torch.tensor([scheduled[i].request.seed for i in rows], dtype=torch.int64),
        sample_positions=inputs.sample_positions.to(torch.int64),
        num_logprobs=max((p.logprobs for p in params), default=0),
        return_logprobs=any(p.logprobs for p in params),  # else the sampler skips log-sum-exp
        penalties=build_logit_penalties([(params[i], scheduled[i].request.prompt_token_ids,
                                          scheduled[i].request.output_token_ids) for i in rows])
        if any(p.has_penalties for p in params) else None,
    )
    prompt_fields, offsets = {}, None
    if inputs.num_prompt_rows:
        prompt_fields = _prompt_fields(scheduled, inputs)
        offsets = inputs.prompt_row_offsets.tolist()
    plan = StepPlan(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        seq_slots=[s.slot for s in scheduled],
        query_lens=[len(s.token_ids) for s in scheduled],
        context_lens=[s.start_position for s in scheduled],
        selected_token_indices=inputs.selected_token_indices,
        sampling=sampling,
        guided=guided,
        **prompt_fields,
    )
    return plan, offsets


def _prompt_fields(scheduled: List[ScheduledRequest], inputs) -> dict:
    """StepPlan fields for prompt logprobs: rows, the prompt tokens they score, top-n."""
    offsets = inputs.prompt_row_offsets.tolist()
    targets = inputs.prompt_target_positions.tolist()
    target_ids: List[int] = []
    for i, s in enumerate(scheduled):
        prompt = s.request.prompt_token_ids
        target_ids.extend(prompt[p] for p in targets[offsets[i]:offsets[i + 1]])
    return dict(
        selected_prompt_indices=inputs.selected_prompt_indices,
        prompt_target_ids=torch.tensor(target_ids, dtype=torch.int64),
        num_prompt_logprobs=max((s.request.sampling_params.prompt_logprobs or 0) for s in scheduled),
    )


# ---------------------------------------------------------------------- finishing

class StepFinisher:
    """The driver's step postprocessing.

    Parameters
    ----------
    stop_token_ids : set of int
        Ids that end a request with ``"stop"`` (unless ``ignore_eos``).
    max_model_len : int
    speculator : Speculator or None
    detokenize : callable, optional
        Token ids -> output text; needed for requests with stop strings.
    """

    def __init__(self, stop_token_ids: Set[int], max_model_len: int, speculator=None,
                 detokenize: Optional[Callable[[Sequence[int]], str]] = None) -> None:
        self.stop_token_ids = stop_token_ids
        self.max_model_len = max_model_len
        self.spec = speculator
        self.detokenize = detokenize

    def finish(self, planned: PlannedStep, result: StepResult, guided, dead_end_rows: Sequence[int] = ()) -> None:
        """Apply one step's result to its requests (see the module docstring).

        Parameters
        ----------
        guided : GuidedDecoder or None
            The driver's matchers.
        dead_end_rows : sequence of int
            Sample rows whose bitmask fill failed (a dead end, or a matcher that raised).
        """
        step = planned.number
        for row in dead_end_rows:  # the bitmask fill failed there: the request fails first
            self._fail_guided_row(planned.owner_of_row(row).request, guided, step)
        now = time.perf_counter()
        for i, s in enumerate(planned.scheduled):
            req, first_row = s.request, planned.first_rows[i]
            req.num_computed_tokens += len(s.token_ids)
            if req.is_finished or not s.samples:
                continue
            if self.spec is not None and not s.is_prefill:
                self._append_verified(req, s.token_ids[1:1 + s.num_draft_tokens], result, first_row, guided, step)
            elif result.bad_rows[first_row]:
                self._fail_bad_row(req, result, first_row, step)
            else:
                self._append(req, result.token_ids[first_row], result, first_row, guided, step)
            req.first_token_time = req.first_token_time or now

    def record_prompt_logprobs(self, planned: PlannedStep, result: StepResult) -> None:
        """Append this step's prompt logprobs to their requests."""
        prompt, offsets = result.prompt_logprobs, planned.prompt_row_offsets
        if prompt is None or offsets is None:
            return
        logprobs, top_ids, top_lps = prompt.logprobs.tolist(), prompt.top_ids.tolist(), prompt.top_logprobs.tolist()
        targets = planned.plan.prompt_target_ids.tolist()
        for i, s in enumerate(planned.scheduled):
            n = s.request.sampling_params.prompt_logprobs or 0
            for row in range(offsets[i], offsets[i + 1]):
                s.request.prompt_logprobs.append({
                    "token_id": targets[row],
                    "logprob": logprobs[row],
                    "top": [[i_, lp] for i_, lp in zip(top_ids[row][:n], top_lps[row][:n])],
                })

    # ------------------------------------------------------------------ failures
    @staticmethod
    def _fail_guided_row(req: Request, guided, step: int) -> None:
        reason = guided.failure_reason(req.slot) if guided is not None else None
        if reason is not None and "dead end" not in reason:  # the matcher raised: say so, with its reason
            req.fail(f"grammar matcher failed at step {step} after {len(req.output_token_ids)} generated "
                     f"tokens: {reason}")
        else:
            req.fail(f"grammar dead end at step {step}: no token is allowed after "
                     f"{len(req.output_token_ids)} generated tokens")

    @staticmethod
    def _fail_bad_row(req: Request, result: StepResult, row: int, step: int) -> None:
        note = result.bad_row_notes.get(row, "all -inf or NaN")
        req.fail(f"non-finite logits at step {step}: {note}")
        print(f"[rank 0] step {step}: request {req.request_id!r} failed: {req.error}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ tokens
    def _append_verified(self, req: Request, drafts, result: StepResult, first_row: int, guided, step: int) -> None:
        """Speculative decode: append the verified window, truncated at the first stop condition."""
        verdict = self.spec.verify(drafts, result.token_ids, first_row)
        a = verdict.num_accepted
        req.num_computed_tokens -= len(drafts) - a  # rejected positions: overwritten by later steps
        accepted = a  # drafts the matcher already advanced through (clamped at a terminated matcher)
        if req.structured_output is not None and guided is not None and hasattr(guided, "rollback_rejected"):
            try:
                accepted = guided.rollback_rejected(req.slot, a)
            except SpecAccountingError as exc:  # a bug: report it loudly, fail this request only
                print(f"[rank 0] speculative accounting bug for request {req.request_id!r}: {exc}",
                      file=sys.stderr, flush=True)
                req.fail(f"internal error (speculative accounting): {exc}")
                return
            except ValueError as exc:
                req.fail(str(exc))
                return
        for j in range(accepted + 1):
            row = verdict.rows[j]
            if result.bad_rows[row]:
                self._fail_bad_row(req, result, row, step)
                return
            if j < accepted:  # the matcher advanced through this draft while filling the rows
                # it can only be terminated after the last draft it advanced through
                terminated = j == accepted - 1 and guided is not None and guided.is_terminated(req.slot)
                self._append(req, verdict.token_ids[j], result, row, guided, step,
                             advance_matcher=False, matcher_terminated=terminated)
            else:
                self._append(req, verdict.token_ids[j], result, row, guided, step)
            if req.is_finished:
                return

    def _append(self, req: Request, token: int, result: StepResult, row: int, guided, step: int,
                advance_matcher: bool = True, matcher_terminated: Optional[bool] = None) -> None:
        """Append one output token and check the stop conditions.

        ``advance_matcher=False``: a verified draft the matcher already
        accepted while the rows were filled; ``matcher_terminated`` then says
        whether the matcher is terminated after it.
        """
        req.output_token_ids.append(token)
        if req.sampling_params.logprobs:
            n = req.sampling_params.logprobs
            req.output_logprobs.append({
                "token_id": token,
                "logprob": float(result.logprobs[row]),
                "top": [[int(i), float(v)] for i, v in
                        zip(result.top_logprob_ids[row, :n].tolist(), result.top_logprobs[row, :n].tolist())],
            })
        if req.structured_output is not None and guided is not None:
            if advance_matcher:
                try:
                    if not guided.accept_token(req.slot, token):
                        req.fail(f"grammar matcher rejected token {token} at step {step}")
                        return
                except ValueError as exc:
                    req.fail(str(exc))
                    return
                matcher_terminated = guided.is_terminated(req.slot)
            if matcher_terminated:
                self.finish_stop(req)
                return
        if token in self.stop_token_ids and not req.sampling_params.ignore_eos:
            self.finish_stop(req)
        elif req.sampling_params.stop and self._hit_stop_string(req):
            self.finish_stop(req)
        elif len(req.output_token_ids) >= req.sampling_params.max_tokens:
            req.finish("length")
        elif req.num_tokens >= self.max_model_len:
            req.finish("length")

    def _hit_stop_string(self, req: Request) -> bool:
        cut = find_stop_string(self.detokenize, req.output_token_ids, req.sampling_params.stop)
        if cut is None:
            return False
        req.stop_text_cut = cut
        return True

    def finish_stop(self, req: Request) -> None:
        """The one point where a request finishes with ``"stop"`` (its constraint, if any, is complete)."""
        req.finish("stop")


# ---------------------------------------------------------------------- the driver

#: ``(token_bitmask [R, bitmask_size], token_mask [R], failed sample rows)`` of one fill.
Filled = Tuple[torch.Tensor, torch.Tensor, List[int]]


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
    """

    def __init__(self, tokenizer, stop_token_ids: Sequence[int], padded_vocab_size: int, config) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.padded_vocab_size = padded_vocab_size
        self.guided: Optional[GuidedDecoder] = None  # built on the first guided request (takes a few seconds)
        self.spec: Optional[Speculator] = None  # drafting and verification, with speculative decoding
        if config.speculative_method is not None:
            self.spec = Speculator(config.speculative_method, config.num_speculative_tokens, config.max_model_len)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens,
                                   propose_drafts=self.spec.propose if self.spec else None)
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
            if self.spec is None:
                self.guided = GuidedDecoder(backend, self.padded_vocab_size, self.config.max_num_seqs)
            else:  # 1 + K rows per request
                from tpguide.guided.spec_decoder import SpeculativeGuidedDecoder

                self.guided = SpeculativeGuidedDecoder(
                    backend, self.padded_vocab_size,
                    self.config.max_num_seqs * (1 + self.config.num_speculative_tokens))
        return self.guided

    def tokenize(self, req: Request) -> List[int]:
        """Prompt token ids of ``req`` (:func:`tokenize_prompt`)."""
        return tokenize_prompt(self.tokenizer, req)

    def add_request(self, req: Request) -> None:
        """Admit ``req`` (:func:`admit_request`) and queue it; never raises for bad input.

        A guide is checked (fail closed, :mod:`tpguide.guided.admission`) and
        compiled in a worker thread (:class:`~tpguide.guided.admission.CompileService`);
        requests join the scheduler in arrival order, each once its guide is
        admitted, while the running ones keep stepping.
        """
        if not req.is_finished:
            try:
                admit_request(req, self.tokenizer, self.config, self._submit_guide(req))
            except ValueError as exc:
                req.fail(str(exc))
        if req.is_finished:
            self._unreported.append(req)
        else:
            self._arrivals.append(req)
            self._admit_arrivals()

    def _submit_guide(self, req: Request):
        def submit(params) -> None:
            self._compiles.submit(req.index, functools.partial(admit, self.guided_decoder().backend, params))
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
            for req in [r for r in self.scheduler.running.values() if r.request_id in aborts and not r.is_finished]:
                req.finish("abort")
                self._release(req)  # slot, bitmask row and matcher; the KV slot is overwritten by its next user
                self._unreported.append(req)
        outputs = [self.output_of(req) for req in self._unreported]
        self._unreported.clear()
        return outputs

    # ------------------------------------------------------------ the step
    def plan_step(self, draft=None) -> Optional[PlannedStep]:
        """Schedule the next step and plan it; None when nothing can be scheduled.

        Parameters
        ----------
        draft : callable, optional
            ``draft(guided, requests) -> drafts``: the drafts of the decode
            requests (a list of :class:`~tpguide.speculative.draft_loop.DraftRequest`);
            speculative ``draft-head``: a collective drafting loop.
        """
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return None
        for s in scheduled:
            req = s.request
            if s.start_position == 0 and req.structured_output is not None:
                try:
                    self.guided_decoder().add_request(s.slot, req.structured_output)
                except ValueError as exc:
                    req.fail(str(exc))
        if draft is not None:
            scheduled = self._with_drafts(scheduled, draft)
        self.num_steps += 1
        return planned_step_of(self.num_steps, scheduled)

    def _with_drafts(self, scheduled: List[ScheduledRequest], draft) -> List[ScheduledRequest]:
        """``scheduled`` with its reserved draft positions replaced by the drafter's drafts."""
        drafting = [s for s in scheduled if s.num_draft_tokens and not s.request.is_finished]
        requests = [DraftRequest(slot=s.slot, last_token=s.token_ids[0], position=s.start_position,
                                 max_drafts=s.num_draft_tokens,
                                 guided=(self.guided is not None and s.request.structured_output is not None
                                         and self.guided.is_guided(s.slot)))
                    for s in drafting]
        found = {id(s): d for s, d in zip(drafting, draft(self.guided, requests))}
        return [dataclasses.replace(s, token_ids=s.token_ids[:1] + found.get(id(s), []),
                                    num_draft_tokens=len(found.get(id(s), [])))
                if s.num_draft_tokens else s for s in scheduled]

    def fill_bitmask(self, planned: PlannedStep) -> Filled:
        """Fill the guided rows of ``planned`` (runs in a thread while the forward runs)."""
        if self.spec is not None:
            token_bitmask, token_mask, failed = self.guided.fill_bitmask_with_drafts(planned.bitmask_entries())
        else:
            token_bitmask, token_mask, failed = self.guided.fill_bitmask(planned.guided_slots)
        for row in failed:
            token_mask[row] = 0  # the fill already reset the row; the request fails in finish_step
        return token_bitmask, token_mask, list(failed)

    @staticmethod
    def bitmask_slices(filled: Filled, tp_size: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """``(token_mask, per-rank word slices)`` of a fill, for the scatter."""
        token_bitmask, token_mask, _ = filled
        return token_mask, split_bitmask(token_bitmask, tp_size)

    def finish_step(self, planned: PlannedStep, result: StepResult,
                    dead_end_rows: Sequence[int] = ()) -> List[RequestOutput]:
        """Apply the step's result (:class:`StepFinisher`); the outputs of the requests that changed.

        ``dead_end_rows``: the sample rows whose bitmask fill failed (:meth:`fill_bitmask`).
        """
        self.finisher.record_prompt_logprobs(planned, result)
        self.finisher.finish(planned, result, self.guided, dead_end_rows)
        outputs = []
        for s in planned.scheduled:
            req = s.request
            if req.is_finished:
                self._release(req)
            if req.is_finished or len(req.output_token_ids) > req.num_reported_tokens:
                outputs.append(self.output_of(req))
        return outputs

    def _release(self, req: Request) -> None:
        """Free the slot, bitmask row and matcher of a finished request (idempotent)."""
        if req.slot is not None and self.scheduler.running.get(req.slot) is req:
            if self.guided is not None and req.structured_output is not None:
                self.guided.remove_request(req.slot)
            self.scheduler.release(req)

    # ------------------------------------------------------------ outputs
    def output_of(self, req: Request) -> RequestOutput:
        """``req``'s output now: the delta since the last report plus the totals."""
        ids = req.output_token_ids
        start = req.num_reported_tokens
        req.num_reported_tokens = len(ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
        if req.stop_text_cut is not None:  # finished at a stop string: the text ends before it
            text = text[:req.stop_text_cut]
        if req.finish_reason == "stop" and req.structured_output is not None:
            invalid = validate_output(req.structured_output, text)  # the last line of defence (fail closed)
            if invalid is not None:
                req.finish_reason, req.error = "error", invalid
        elapsed = (req.finish_time or time.perf_counter()) - req.arrival_time
        want_logprobs = bool(req.sampling_params.logprobs)
        return RequestOutput(
            request_id=req.request_id, index=req.index,
            new_token_ids=list(ids[start:]), token_ids=list(ids), text=text,
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
