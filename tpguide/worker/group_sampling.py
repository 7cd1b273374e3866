"""The vocab-parallel sampler bound to the TP group: the sampling mathematics' exchange over real collectives.

docs/architecture.md §6.  :mod:`tpguide.sampling` holds the
mathematics and never imports ``torch.distributed``; :class:`GroupExchange`
binds its exchange protocol (:mod:`tpguide.sampling.exchange`) to the thin
collectives of :mod:`tpguide.dist.group` (:func:`sample`,
:func:`compute_prompt_logprobs`).
"""

from __future__ import annotations

import torch

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.model.vocab_shard import VocabShard
from tpguide.sampling.exchange import PerRank
from tpguide.sampling.greedy import greedy_sample, takes_greedy_shortcut
from tpguide.sampling.prompt_logprobs import PromptLogprobs, check_prompt_inputs, prompt_logprobs_with_exchange
from tpguide.sampling.sampler import SamplerOutput, SamplingMetadata, check_sampler_inputs, sample_with_exchange


class GroupExchange:
    """``gather`` = all-gather, ``reduce_sum`` = all-reduce over ``group`` (identity at tp_size 1)."""

    def __init__(self, logits_shard: torch.Tensor, shard: VocabShard, group: TPGroup) -> None:
        if (shard.tp_rank, shard.tp_size) != (group.tp_rank, group.tp_size):
            raise ValueError(f"shard is rank {shard.tp_rank} of {shard.tp_size} but group is rank "
                             f"{group.tp_rank} of {group.tp_size}")
        self.logits_shard, self.shard, self.group = logits_shard, shard, group

    def gather(self, fn: PerRank) -> torch.Tensor:
        """``fn`` on this rank's shard, all-gathered: ``[tp_size, *shape]``."""
        return C.all_gather_stacked(fn(self.logits_shard, self.shard), self.group)

    def reduce_sum(self, fn: PerRank) -> torch.Tensor:
        return C.all_reduce(fn(self.logits_shard, self.shard), self.group, op="sum")


def sample(logits_shard: torch.Tensor, meta: SamplingMetadata, shard: VocabShard, group: TPGroup) -> SamplerOutput:
    """Sample one token per row from vocabulary-sharded logits; same result on every rank.

    Parameters
    ----------
    logits_shard : Tensor, float32 (or fp16/bf16, upcast exactly) [rows, V_local]
        This rank's logits, ``V_local = shard.num_embeddings_per_partition``,
        bitmask already applied, padded ids ``-inf``.  Not modified.
    meta : SamplingMetadata
        Identical on every rank.
    shard : VocabShard
        This rank's vocabulary slice (``shard.tp_rank == group.tp_rank``).
    group : TPGroup
        Called collectives: one all-gather, one all-reduce, more all-gathers
        only when a top-p nucleus outgrows the candidates.

    Returns
    -------
    SamplerOutput
        On ``logits_shard``'s device, identical on every rank and for every tp_size.

    Raises
    ------
    ValueError
        Shape mismatch, shard/group mismatch, ``num_logprobs > org_vocab_size``
        or a vocabulary above ``2**19`` tokens.
    TypeError
        Non-floating logits.
    """
    exchange = GroupExchange(logits_shard, shard, group)
    check_sampler_inputs(logits_shard, meta, shard)
    if takes_greedy_shortcut(meta, shard):  # tp 1, all greedy, no logprobs: the same output, 9 ops
        return greedy_sample(logits_shard, shard)
    return sample_with_exchange(exchange, meta, shard)


def compute_prompt_logprobs(logits_shard: torch.Tensor, target_ids: torch.Tensor, num_top: int,
                            shard: VocabShard, group: TPGroup) -> PromptLogprobs:
    """Logprob of each row's target token and the top-``num_top`` logprobs; same on every rank.

    Parameters
    ----------
    logits_shard : Tensor, float32 [rows, V_local]
        This rank's raw logits of the prompt rows (padded ids ``-inf``).  Not modified.
    target_ids : Tensor, int64 [rows]
        Global id of the prompt token each row scores; the same on every rank.
    num_top : int
        Top logprobs per row, ``>= 0``.
    shard : VocabShard
    group : TPGroup
        Collectives: one all-gather, one all-reduce (nothing at tp_size 1).

    Raises
    ------
    ValueError
        Shapes that do not match, a negative ``num_top``, or a shard of another rank.
    """
    exchange = GroupExchange(logits_shard, shard, group)
    check_prompt_inputs(logits_shard, target_ids, num_top, shard)
    return prompt_logprobs_with_exchange(exchange, target_ids, num_top, shard.org_vocab_size)
