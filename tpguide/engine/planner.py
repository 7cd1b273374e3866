"""Planning a step: the scheduler's choice becomes one :class:`ScheduledStep` value (driver only).

docs/architecture.md §1, §4.
A scheduled step holds everything the step needs: the :class:`StepPlan`
broadcast to every rank, and the driver's own bookkeeping (which request
owns which sample row, which rows are guided, where each request's prompt
logprob rows are).  The driver finishes the step from this value and the
ranks' :class:`~tpguide.worker.protocol.StepResult` (:class:`StepFinisher`);
nothing travels through fields that one caller sets and another reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from tpguide.engine.scheduler import ScheduledRequest
from tpguide.sampling.penalties import build_logit_penalties
from tpguide.sampling.sampler import SamplingMetadata
from tpguide.sampling.sampler_inputs import ScheduledSeq, prepare_sampler_inputs
from tpguide.worker.protocol import StepPlan


@dataclass(frozen=True)
class ScheduledStep:
    """One step on the driver: its scheduled requests, their rows, and the :class:`StepPlan` built for them.

    The ranks see only ``plan`` (the wire message); the rest is the driver's
    bookkeeping for the fill and the finish.

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


def scheduled_step_of(number: int, scheduled: Sequence[ScheduledRequest]) -> ScheduledStep:
    """The :class:`ScheduledStep` of ``scheduled`` (their drafts already filled in).

    A request is guided this step when its sample is used and it has a
    structured output (or thinks under a budget, docs/reasoning.md) and is not finished (a request that failed at
    scheduling keeps its rows, unguided, and its sample is discarded).
    """
    scheduled = list(scheduled)
    guided_slots = [
        s.slot if (s.samples and s.request.has_grammar_state and not s.request.is_finished) else None
        for s in scheduled
    ]
    first_rows = [0]
    for s in scheduled:
        first_rows.append(first_rows[-1] + 1 + s.num_draft_tokens)
    plan, prompt_row_offsets = build_step_plan(scheduled, guided=any(r is not None for r in guided_slots))
    return ScheduledStep(number, plan, scheduled, first_rows, guided_slots, prompt_row_offsets)


def build_step_plan(scheduled: List[ScheduledRequest], guided: bool) -> Tuple[StepPlan, Optional[List[int]]]:
    """Flatten the scheduled requests into a :class:`StepPlan` and the prompt-logprob row offsets.

    Every scheduled request contributes ``1 + num_draft_tokens`` sample rows (docs/architecture.md §4: a
    non-final prefill chunk's row is computed and its sample discarded).
    """
    seqs = [
        ScheduledSeq(
            query_len=len(s.token_ids),
            num_computed_tokens=s.start_position,
            prompt_len=s.request.prefill_len,
            is_prefill=s.is_prefill,
            is_last_prefill_chunk=s.is_prefill and s.samples,
            num_draft_tokens=s.num_draft_tokens,
            # a recompute after a preemption has its prompt logprobs already
            want_prompt_logprobs=(s.request.sampling_params.prompt_logprobs is not None
                                  and s.request.num_prefill_tokens is None),
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
        block_tables=[list(s.request.block_ids) for s in scheduled],
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
