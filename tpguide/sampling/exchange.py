"""The exchange protocol of the vocab-parallel sampler, and its one-process implementation.

The sampling mathematics (:mod:`tpguide.sampling.sampler`,
:mod:`tpguide.sampling.prompt_logprobs`) never calls ``torch.distributed``.
It talks to the other ranks through an injected *exchange* with two methods,
each given ``fn(logits_shard, vocab_shard) -> Tensor`` (one rank's payload):

* ``gather(fn) -> Tensor [tp_size, *payload]``: every rank's payload, stacked
  in rank order (an all-gather);
* ``reduce_sum(fn) -> Tensor [*payload]``: the element-wise sum over ranks
  (an all-reduce; int64 payloads, so the sum is exact and order-free).

:class:`ShardsByHand` holds every rank's shard in one process (the oracle of
shard-by-hand tests and of anyone checking a sharded run);
:class:`tpguide.worker.group_sampling.GroupExchange` does the same over a
real TP group.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from tpguide.model.vocab_shard import VocabShard

#: One rank's payload: ``fn(logits_shard [rows, V_local], vocab_shard) -> Tensor``.
PerRank = Callable[[torch.Tensor, VocabShard], torch.Tensor]


class ShardsByHand:
    """Every rank's logits shard in one process: ``gather`` stacks, ``reduce_sum`` sums.

    Parameters
    ----------
    logits_shards : sequence of Tensor, float [rows, V_local]
        Rank ``r``'s shard at index ``r``.
    shards : sequence of VocabShard
        Rank ``r``'s vocabulary slice at index ``r``.
    """

    def __init__(self, logits_shards: Sequence[torch.Tensor], shards: Sequence[VocabShard]) -> None:
        self.pairs = list(zip(logits_shards, shards, strict=True))

    def gather(self, fn: PerRank) -> torch.Tensor:
        return torch.stack([fn(x, s) for x, s in self.pairs])

    def reduce_sum(self, fn: PerRank) -> torch.Tensor:
        return torch.stack([fn(x, s) for x, s in self.pairs]).sum(dim=0)
