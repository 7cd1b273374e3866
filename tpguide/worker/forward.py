"""The step's eager forward on one rank: inputs -> hidden -> prompt logprobs, sample-row logits.

docs/architecture.md §1.

One implementation for the plain step (the plan's own tensors,
:func:`plain_inputs`) and the eager step over the persistent buffers
(:meth:`~tpguide.worker.step_inputs.StepBuffers.stage`, the CUDA fast path of
:mod:`tpguide.worker.fast_path`): both hand :func:`eager_forward` a
:class:`~tpguide.worker.step_inputs.StepInputs`.  A CUDA-graph step replays
:func:`~tpguide.worker.cuda_graphs.forward_logits` instead.  Penalties, the
bitmask and sampling come after, in :mod:`tpguide.worker.runner`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tpguide.dist import TPGroup
from tpguide.model.attention import AttentionMetadata
from tpguide.sampling.prompt_logprobs import PromptLogprobs
from tpguide.sampling.sampler import SamplingMetadata
from tpguide.worker.group_sampling import compute_prompt_logprobs
from tpguide.worker.protocol import StepPlan
from tpguide.worker.step_inputs import StepInputs

__all__ = ["ForwardOutput", "PROMPT_ROW_BLOCK", "plain_inputs", "eager_forward"]

#: Prompt rows per LM-head call: bounds the ``[rows, V_local]`` fp32/fp64 temporaries.
PROMPT_ROW_BLOCK = 256


@dataclass(frozen=True)
class ForwardOutput:
    """What :meth:`~tpguide.worker.runner.StepRunner.execute_model` hands to ``sample_tokens`` (this rank's device).

    Attributes
    ----------
    logits : torch.Tensor
        fp32 ``[R, V_pad / tp_size]``: this rank's logits shard of the sample
        rows, penalties applied (once ``execute_model`` returns), the bitmask not yet.
    sampling : SamplingMetadata
        The plan's, on this rank's device (the staged views on the persistent-buffer path).
    prompt : PromptLogprobs or None
        The rows of ``plan.selected_prompt_indices``, on the host.
    """

    logits: torch.Tensor
    sampling: SamplingMetadata
    prompt: Optional[PromptLogprobs]


def plain_inputs(plan: StepPlan, device: torch.device, block_size: int) -> StepInputs:
    """``plan``'s own tensors on ``device``, unpadded: the plain step's inputs (no persistent buffers).

    ``block_size``: the model's KV block size (tokens).
    """
    meta = AttentionMetadata.from_block_tables(plan.block_tables, plan.query_lens, plan.context_lens, device=device,
                                               block_size=block_size)
    rows = plan.selected_token_indices.to(device=device, dtype=torch.int64)
    return StepInputs(plan.input_ids.to(device), meta.token_positions, meta, rows, plan.input_ids.numel(),
                      rows.numel(), plan.sampling.to(device))


def eager_forward(model, inputs: StepInputs, plan: StepPlan, group: TPGroup) -> ForwardOutput:
    """The forward over ``inputs``, prompt logprobs if ``plan`` asks, the LM-head shard over the sample rows.

    A collective (the model's and the prompt logprobs'): every rank calls it with the same plan.

    Parameters
    ----------
    model : LlamaForCausalLM
        This rank's shard.
    inputs : StepInputs
        :func:`plain_inputs`, or the plan staged unpadded in the persistent buffers.
    plan : StepPlan
        The prompt-logprob rows and targets (read on the host: a prompt-logprob step is not sync-free).
    group : TPGroup

    Returns
    -------
    ForwardOutput
        fp32 logits ``[R, V_pad / tp_size]`` (no penalties yet), ``inputs.sampling``, the prompt logprobs.
    """
    hidden = model(inputs.input_ids, inputs.positions, inputs.meta)  # [T, H]
    prompt = None
    if plan.selected_prompt_indices is not None:
        prompt = _prompt_logprobs(model, hidden, plan, group)
    logits = model.compute_logits(hidden[inputs.selected])  # [R, V_pad / tp] fp32
    return ForwardOutput(logits, inputs.sampling, prompt)


def _prompt_logprobs(model, hidden: torch.Tensor, plan: StepPlan, group: TPGroup) -> PromptLogprobs:
    """Prompt logprobs of ``plan.selected_prompt_indices``, in blocks of :data:`PROMPT_ROW_BLOCK` rows."""
    rows = plan.selected_prompt_indices.to(device=hidden.device, dtype=torch.int64)
    targets = plan.prompt_target_ids.to(hidden.device)
    parts = []
    for start in range(0, rows.numel(), PROMPT_ROW_BLOCK):
        block = slice(start, start + PROMPT_ROW_BLOCK)
        logits = model.compute_logits(hidden[rows[block]])  # [B, V_pad / tp] fp32
        out = compute_prompt_logprobs(logits, targets[block], plan.num_prompt_logprobs, model.vocab_shard, group)
        parts.append(PromptLogprobs(out.logprobs.cpu(), out.top_ids.cpu(), out.top_logprobs.cpu()))
    return PromptLogprobs.cat(parts, plan.num_prompt_logprobs)
