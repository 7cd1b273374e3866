"""Host-side step plans for the runner's tests (no tests of its own)."""

from __future__ import annotations

import torch


def step_plan(seqs, guided: bool, step: int):
    """A StepPlan of ``seqs`` = [(block table, context_len, new ids, sample rows)]: rows are each sequence's last.

    Greedy and sampled rows alternate; seeds and positions follow ``step``;
    two logprobs per row.
    """
    from tpguide.sampling.sampler import SamplingMetadata
    from tpguide.worker.protocol import StepPlan

    ids = [i for _, _, toks, _ in seqs for i in toks]
    selected, positions, offset = [], [], 0
    for _, ctx, toks, rows in seqs:
        offset += len(toks)
        selected += list(range(offset - rows, offset))
        positions += [ctx + len(toks) - rows + j + 1 for j in range(rows)]
    n = len(selected)
    sampling = SamplingMetadata(temperature=torch.tensor([0.0, 0.8] * n)[:n], top_k=torch.zeros(n, dtype=torch.int32),
                                top_p=torch.ones(n), seeds=torch.arange(n, dtype=torch.int64) + 11 * step,
                                sample_positions=torch.tensor(positions), num_logprobs=2)
    return StepPlan(input_ids=torch.tensor(ids), block_tables=[t for t, _, _, _ in seqs],
                    query_lens=[len(t) for _, _, t, _ in seqs], context_lens=[c for _, c, _, _ in seqs],
                    selected_token_indices=torch.tensor(selected, dtype=torch.int32), sampling=sampling,
                    guided=guided)
