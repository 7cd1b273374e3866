"""Test helpers for the sampler side: shard a full logits tensor by hand.

Like ``tests/guided_testing.py``: used by ``tests/``; nothing here runs in
the engine.
"""

from __future__ import annotations

import torch

from tpguide.model.vocab_shard import VocabShard


def shard_logits(full: torch.Tensor, tp_size: int) -> tuple[list[torch.Tensor], list[VocabShard]]:
    """Split ``full`` fp32 ``[rows, org_vocab_size]`` into the ``tp_size`` ranks' logits shards.

    Returns
    -------
    (shards, vocab_shards)
        ``shards[r]`` is rank ``r``'s ``[rows, padded_vocab_size // tp_size]``
        view, padded ids ``-inf`` (as :meth:`ParallelLMHead.compute_logits`
        produces them); ``vocab_shards[r]`` its :class:`VocabShard`.
    """
    org = full.shape[1]
    shards = [VocabShard.create(org, r, tp_size) for r in range(tp_size)]
    padded = torch.full((full.shape[0], shards[0].padded_vocab_size), float("-inf"))
    padded[:, :org] = full
    return [padded[:, s.vocab_start_index:s.vocab_end_index] for s in shards], shards
