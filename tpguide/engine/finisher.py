"""Finishing a step: (planned step, step result, dead-end rows) -> appended tokens and the stop checks (driver only).

docs/architecture.md §5.  Once per step, finished
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

import sys
import time
from typing import Callable, Optional, Sequence, Set

from tpguide.engine.planner import PlannedStep
from tpguide.engine.request import Request
from tpguide.engine.stop_strings import find_stop_string
from tpguide.guided.spec_counters import SpecAccountingError
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
