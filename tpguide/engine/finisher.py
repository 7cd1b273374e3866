"""Finishing a step: (scheduled_step step, step result, dead-end rows) -> appended tokens and the stop checks (driver only).

docs/architecture.md §1 ("One step, stage by stage", 9) and §5.  :meth:`Driver.finish_step
<tpguide.engine.driver.Driver.finish_step>` calls :meth:`StepFinisher.finish`
once per step, then reports the requests that changed or finished.  In order:

1. guided rows whose bitmask fill failed fail their request, by the slot
   record's :class:`~tpguide.guided.slot_record.GuideFailure` (a dead end,
   or a matcher that raised, with its message);
2. every scheduled request advances ``num_computed_tokens``; a request whose
   sample is used gets its token (plain decode) or its verified window
   (speculative: ``d_1 .. d_a, y_a`` from :meth:`Speculator.verify`), each
   token accepted by the matcher on the same path;
3. each appended token is checked for the stop conditions, in this order:
   grammar (the matcher rejects it, or is terminated after it: ``"stop"``),
   stop token (unless ``ignore_eos``), stop string (:mod:`tpguide.engine.stop_strings`),
   ``max_tokens``, ``max_model_len``.

:meth:`StepFinisher.finish_stop` is the one place where a request finishes
with ``"stop"``.
"""

from __future__ import annotations

import sys
import time
from typing import AbstractSet, Callable, Optional, Sequence, Set

from tpguide.engine.planner import ScheduledStep
from tpguide.engine.request import Request
from tpguide.engine.request_faults import contained
from tpguide.engine.stop_strings import find_stop_string
from tpguide.guided.slot_record import GuideFailure
from tpguide.worker.protocol import StepResult


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

    def finish(self, scheduled_step: ScheduledStep, result: StepResult, guided, dead_end_rows: Sequence[int] = (),
               forced_rows: AbstractSet[int] = frozenset()) -> None:
        """Apply one step's result to its requests (see the module docstring).

        Parameters
        ----------
        guided : GuidedDecoder or None
            The driver's matchers.
        dead_end_rows : sequence of int
            Sample rows whose bitmask fill failed (a dead end, or a matcher that raised).
        forced_rows : set of int
            Sample rows whose mask allowed one token id: a token appended from one counts as forced
            (``Request.num_forced_tokens``, the receipt).
        """
        step = scheduled_step.number
        for row in dead_end_rows:  # the bitmask fill failed there: the request fails first
            self._fail_guided_row(scheduled_step.owner_of_row(row).request, guided, step)
        now = time.perf_counter()
        for i, s in enumerate(scheduled_step.scheduled):
            req, first_row = s.request, scheduled_step.first_rows[i]
            req.num_computed_tokens += len(s.token_ids)
            if req.is_finished or not s.samples:
                continue
            with contained(req, "finish"):  # an exception fails this request alone (request_faults.py)
                self._finish_one(req, s, first_row, result, guided, step, forced_rows)
            req.first_token_time = req.first_token_time or now

    def _finish_one(self, req: Request, s, first_row: int, result: StepResult, guided, step: int,
                    forced_rows: AbstractSet[int]) -> None:
        """Append one scheduled request's sampled (or verified) tokens and check its stop conditions."""
        before = len(req.output_token_ids)
        if self.spec is not None and not s.is_prefill:
            self._append_verified(req, s.token_ids[1:1 + s.num_draft_tokens], result, first_row, guided, step,
                                  forced_rows)
        elif result.bad_rows[first_row]:
            self._fail_bad_row(req, result, first_row, step)
        else:
            self._append(req, result.token_ids[first_row], result, first_row, guided, step, forced_rows)
        if self.spec is not None:
            self.spec.stats.record_pass(len(req.output_token_ids) - before)

    def record_prompt_logprobs(self, scheduled_step: ScheduledStep, result: StepResult) -> None:
        """Append this step's prompt logprobs to their requests."""
        prompt, offsets = result.prompt_logprobs, scheduled_step.prompt_row_offsets
        if prompt is None or offsets is None:
            return
        logprobs, top_ids, top_lps = prompt.logprobs.tolist(), prompt.top_ids.tolist(), prompt.top_logprobs.tolist()
        targets = scheduled_step.plan.prompt_target_ids.tolist()
        for i, s in enumerate(scheduled_step.scheduled):
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
        """Fail the request whose row 0 the fill could not fill, by the record's :class:`GuideFailure`."""
        if guided is not None and guided.failure_kind(req.slot) is GuideFailure.MATCHER_ERROR:  # say so, and why
            req.fail(f"grammar matcher failed at step {step} after {len(req.output_token_ids)} generated "
                     f"tokens: {guided.failure_reason(req.slot)}")
        else:
            req.fail(f"grammar dead end at step {step}: no token is allowed after "
                     f"{len(req.output_token_ids)} generated tokens")

    @staticmethod
    def _fail_bad_row(req: Request, result: StepResult, row: int, step: int) -> None:
        note = result.bad_row_notes.get(row, "all -inf or NaN")
        req.fail(f"non-finite logits at step {step}: {note}")
        print(f"[rank 0] step {step}: request {req.request_id!r} failed: {req.error}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ tokens
    def _append_verified(self, req: Request, drafts, result: StepResult, first_row: int, guided, step: int,
                         forced_rows: AbstractSet[int]) -> None:
        """Speculative decode: append the verified window token by token, truncated at the first stop condition.

        Each token goes through :meth:`_append`, the matcher accepting it as any
        output token: the bitmask fill rolled its drafts back at once
        (:mod:`tpguide.guided.decoder`), so nothing is rolled back here.
        """
        record = guided.record(req.slot) if guided is not None else None
        forced = record is not None and record.forced
        verdict = self.spec.verify(drafts, result.token_ids, first_row, forced=forced)
        req.num_draft_tokens += len(drafts)  # the receipt's counters (tpguide/engine/receipt.py)
        req.num_accepted_draft_tokens += verdict.num_accepted
        if forced:
            req.num_grammar_draft_tokens += len(drafts)
            req.num_accepted_grammar_draft_tokens += verdict.num_accepted
        req.num_computed_tokens -= len(drafts) - verdict.num_accepted  # rejected positions: overwritten later
        for token, row in zip(verdict.token_ids, verdict.rows):
            if result.bad_rows[row]:
                self._fail_bad_row(req, result, row, step)
                return
            self._append(req, token, result, row, guided, step, forced_rows)
            if req.is_finished:
                return

    def _append(self, req: Request, token: int, result: StepResult, row: int, guided, step: int,
                forced_rows: AbstractSet[int]) -> None:
        """Append one output token, advance the request's matcher by it, check the stop conditions."""
        req.output_token_ids.append(token)
        if row in forced_rows:
            req.num_forced_tokens += 1  # its mask allowed this one token (the receipt)
        if req.sampling_params.logprobs:
            n = req.sampling_params.logprobs
            req.output_logprobs.append({
                "token_id": token,
                "logprob": float(result.logprobs[row]),
                "top": [[int(i), float(v)] for i, v in
                        zip(result.top_logprob_ids[row, :n].tolist(), result.top_logprobs[row, :n].tolist())],
            })
        if req.has_grammar_state and guided is not None:  # its record: thinking, then the matcher
            try:
                if not guided.accept_token(req.slot, token):
                    req.fail(f"grammar matcher rejected token {token} at step {step}")
                    return
            except ValueError as exc:
                req.fail(str(exc))
                return
            if guided.is_terminated(req.slot):
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
