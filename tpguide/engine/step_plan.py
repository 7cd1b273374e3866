"""The step plan: what the driver broadcasts to every rank each step.

Built on the driver from the scheduler's choice
(:class:`~tpguide.engine.scheduler.ScheduledRequest`), sent with one
``broadcast_object``, and turned by every rank into the same model inputs.
Its size is ``O(num_tokens + num_sample_rows)`` integers; the token bitmask
travels separately (each rank receives only its slice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from tpguide.engine.sampler_inputs import ScheduledSeq, prepare_sampler_inputs
from tpguide.engine.sampling_metadata import SamplingMetadata
from tpguide.engine.scheduler import ScheduledRequest


@dataclass
class StepPlan:
    """One step for every rank.

    Attributes
    ----------
    input_ids, positions : torch.Tensor
        int64 ``[num_tokens]``: flattened new tokens and their absolute positions.
    seq_slots, query_lens, context_lens : list of int
        Per scheduled sequence (batch order): KV slot, new tokens, cached tokens.
    selected_token_indices : torch.Tensor
        int32 ``[num_sample_rows]``: rows of the hidden states that go through
        the LM head (DESIGN.md §4), the same on every rank.
    sampling : SamplingMetadata
        Per sample row: temperature, top-k, top-p, seed, sample position.
    guided : bool
        A bitmask (token_mask broadcast + slice scatter) follows the forward.
    stop : bool
        The driver has no more work: every rank leaves its loop.
    selected_prompt_indices : torch.Tensor or None
        int32 ``[num_prompt_rows]``: hidden-state rows whose log-softmax gives
        prompt logprobs (DESIGN.md §4); ``None`` when no request asks for them.
    prompt_target_ids : torch.Tensor or None
        int64 ``[num_prompt_rows]``: the prompt token each of those rows scores.
    prompt_row_offsets : list of int or None
        ``[num_seqs + 1]``: sequence ``i`` owns prompt rows ``[off[i], off[i+1])``.
    num_prompt_logprobs : int
        Top-n prompt logprobs per row (max over the batch).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_slots: List[int]
    query_lens: List[int]
    context_lens: List[int]
    selected_token_indices: torch.Tensor
    sampling: Optional[SamplingMetadata]
    guided: bool = False
    stop: bool = False
    selected_prompt_indices: Optional[torch.Tensor] = None
    prompt_target_ids: Optional[torch.Tensor] = None
    prompt_row_offsets: Optional[List[int]] = None
    num_prompt_logprobs: int = 0

    @classmethod
    def stop_plan(cls) -> "StepPlan":
        empty = torch.empty(0, dtype=torch.int64)
        return cls(empty, empty, [], [], [], empty.int(), None, stop=True)


def build_step_plan(scheduled: List[ScheduledRequest], guided: bool) -> StepPlan:
    """Flatten the scheduled requests into a :class:`StepPlan` (driver only).

    Every scheduled request contributes one sample row (DESIGN.md §4: a
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
    positions: List[int] = []
    for s in scheduled:
        input_ids.extend(s.token_ids)
        positions.extend(range(s.start_position, s.start_position + len(s.token_ids)))
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
    )
    prompt_fields = {}
    if inputs.num_prompt_rows:
        prompt_fields = _prompt_fields(scheduled, inputs)
    return StepPlan(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        seq_slots=[s.slot for s in scheduled],
        query_lens=[len(s.token_ids) for s in scheduled],
        context_lens=[s.start_position for s in scheduled],
        selected_token_indices=inputs.selected_token_indices,
        sampling=sampling,
        guided=guided,
        **prompt_fields,
    )


def _prompt_fields(scheduled: List[ScheduledRequest], inputs) -> dict:
    """StepPlan fields for prompt logprobs: rows, the prompt tokens they score, offsets."""
    offsets = inputs.prompt_row_offsets.tolist()
    targets = inputs.prompt_target_positions.tolist()
    target_ids: List[int] = []
    for i, s in enumerate(scheduled):
        prompt = s.request.prompt_token_ids
        target_ids.extend(prompt[p] for p in targets[offsets[i]:offsets[i + 1]])
    return dict(
        selected_prompt_indices=inputs.selected_prompt_indices,
        prompt_target_ids=torch.tensor(target_ids, dtype=torch.int64),
        prompt_row_offsets=offsets,
        num_prompt_logprobs=max((s.request.sampling_params.prompt_logprobs or 0) for s in scheduled),
    )
