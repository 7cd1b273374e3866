"""Greedy rows without logprobs on one rank: the first maximum in a handful of kernels, the candidate protocol's output.

The vocab-parallel sampler (:func:`tpguide.sampling.sampler.sample_with_exchange`)
builds order keys, a candidate payload, a merge and a finish that serve
every mode; for a step whose rows are all greedy and that wants no
logprobs, at tp 1, that is about 107 small device ops (counted on the meta
device, 32 rows), each an eager launch after the step's CUDA graph.  Its
result is only the first maximum of each row, so here it is that, in 9:
the same token ids, bad rows, logprobs (NaN, ``-inf`` on bad rows), empty
top-logprob tensors and candidate count, bit for bit
(``tests/test_sampler_greedy.py``).  A row is bad when its maximum is not
finite (a NaN, ``+inf``, or every word masked to ``-inf``) or a padded id
wins.  docs/architecture.md §6, "Greedy steps without logprobs at tp 1".
"""

from __future__ import annotations

import torch

from tpguide.model.vocab_shard import VocabShard
from tpguide.sampling.sampler import SamplerOutput, SamplingMetadata, row_modes


def takes_greedy_shortcut(meta: SamplingMetadata, shard: VocabShard) -> bool:
    """Whether :func:`greedy_sample` gives this step's output: tp 1, every row greedy, no logprobs (host data only)."""
    if shard.tp_size != 1 or meta.return_logprobs or meta.num_logprobs > 0:
        return False
    return bool(row_modes(meta, shard.org_vocab_size).greedy.all())


def greedy_sample(logits_shard: torch.Tensor, shard: VocabShard) -> SamplerOutput:
    """Each row's first maximum, as the vocab-parallel sampler gives it for greedy rows without logprobs.

    Parameters
    ----------
    logits_shard : torch.Tensor
        float32 (or fp16 / bf16, upcast exactly) ``[rows, V]``, the whole
        padded vocabulary of a tp-1 shard, bitmask applied; not modified.
    shard : VocabShard
        ``tp_size`` 1: its ``org_vocab_size`` tells the padded ids.

    Returns
    -------
    SamplerOutput
        On ``logits_shard``'s device: int64 ``token_ids [rows]`` (``-1`` on
        bad rows), float32 ``logprobs [rows]`` (NaN: not computed; ``-inf``
        on bad rows), empty ``[rows, 0]`` top logprobs, bool ``bad_rows``,
        ``num_candidates`` 0.

    Raises
    ------
    ValueError
        ``shard`` is not a tp-1 shard, or ``logits_shard`` is not ``[rows, V]``
        of its width.
    """
    if shard.tp_size != 1 or logits_shard.dim() != 2 or logits_shard.shape[1] != shard.num_embeddings_per_partition:
        raise ValueError(f"greedy_sample needs a tp-1 shard's logits [rows, {shard.num_embeddings_per_partition}], "
                         f"got tp_size={shard.tp_size} and logits {list(logits_shard.shape)}")
    row_max, first = logits_shard.to(torch.float32).max(dim=-1)  # NaN propagates; ties: the first (lowest) id
    bad = ~(row_max.abs() < float("inf")) | (first >= shard.org_vocab_size)  # NaN, +-inf, or a padded id
    rows = logits_shard.shape[0]
    return SamplerOutput(
        token_ids=first.masked_fill(bad, -1),
        logprobs=torch.full_like(row_max, float("nan")).masked_fill_(bad, float("-inf")),
        top_logprob_ids=first.new_empty((rows, 0)),
        top_logprobs=row_max.new_empty((rows, 0)),
        bad_rows=bad,
        num_candidates=0,
    )
