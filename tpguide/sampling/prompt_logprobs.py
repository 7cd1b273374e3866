"""Prompt logprobs over a vocabulary-sharded logits tensor (vLLM's ``prompt_logprobs``).

Prompt row ``j`` (docs/architecture.md §4, ``selected_prompt_indices``) holds the
hidden state of prompt position ``p``; its log-softmax scores the prompt
token at ``p + 1`` (the *target*).  Each rank holds logits
``[rows, V_local]`` for global ids ``[vocab_start_index, vocab_end_index)``
and never sees a full row:

* every rank packs, per row, its max key, the key of the target token if the
  target lies in its slice (``INT64_MIN`` otherwise: a masked gather), a
  bad-row flag and its top ``n`` keys (:func:`local_prompt_candidates`);
  one all-gather, then the max over ranks gives the global max logit and the
  target's logit (exactly one rank holds it), and a top-``n`` merge gives
  the global top-``n`` (keys: larger logit first, lower id on ties);
* ``sum(exp(x - max))`` as a fixed-point int64, all-reduced
  (:func:`~tpguide.sampling.sampler.fixed_point_exp_sum`), so the normaliser
  and therefore every logprob are bit-identical for every tp_size.

Bytes per row and rank: ``8 * (3 + n) * tp`` received by the all-gather plus
8 all-reduced, never ``O(vocab)``.  Logprobs are raw: no temperature, no
grammar bitmask (the prompt is not guided).  A row holding a NaN or ``+inf``
logit, or all ``-inf``, gives ``-inf`` logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpguide.model.vocab_shard import VocabShard
from tpguide.sampling.exchange import ShardsByHand
from tpguide.sampling.sampler import FIXED_ONE, fixed_point_exp_sum, key_ids, key_values, order_keys

_HEAD = 3  # max key, target key, bad flag; then the top-n keys
_NO_KEY = torch.iinfo(torch.int64).min


@dataclass(frozen=True)
class PromptLogprobs:
    """Prompt logprobs of some rows, identical on every rank.

    Attributes
    ----------
    logprobs : Tensor, float32 [rows]
        ``log_softmax(logits)[target]`` per row.
    top_ids : Tensor, int64 [rows, n]
        The ``n`` most likely global token ids, larger logit first, lower id on ties.
    top_logprobs : Tensor, float32 [rows, n]
    """

    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    @classmethod
    def empty(cls, num_top: int) -> "PromptLogprobs":
        return cls(torch.empty(0), torch.empty(0, num_top, dtype=torch.int64), torch.empty(0, num_top))

    @classmethod
    def cat(cls, parts: "list[PromptLogprobs]", num_top: int) -> "PromptLogprobs":
        if not parts:
            return cls.empty(num_top)
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("logprobs", "top_ids", "top_logprobs")))


def local_prompt_candidates(logits_shard: torch.Tensor, target_ids: torch.Tensor, shard: VocabShard,
                            num_top: int) -> torch.Tensor:
    """One rank's all-gather payload (pure).

    Parameters
    ----------
    logits_shard : Tensor, float [rows, V_local]
        Not modified.
    target_ids : Tensor, int64 [rows]
        Global id of each row's target token.
    shard : VocabShard
    num_top : int
        ``n``; the rank sends its top ``min(n, V_local)`` keys.

    Returns
    -------
    Tensor, int64 [rows, 3 + min(n, V_local)]
        Max key, target key (``INT64_MIN`` when the target is on another
        rank), 1 if the row holds a NaN or ``+inf``, then the top keys.
    """
    x = logits_shard.to(torch.float32) + 0.0  # [rows, V_local]; -0.0 -> +0.0
    rows, width = x.shape
    start = shard.vocab_start_index
    ids = torch.arange(start, start + width, device=x.device)
    keys = order_keys(x, ids)  # [rows, V_local]
    target = target_ids.to(x.device, torch.int64)
    local = (target >= start) & (target < start + width)
    col = (target - start).clamp(0, width - 1)
    target_key = torch.where(local, keys.gather(-1, col[:, None]).squeeze(-1), _NO_KEY)
    bad = (torch.isnan(x) | (x == float("inf"))).any(dim=-1)
    head = torch.stack([keys.max(dim=-1).values, target_key, bad.to(torch.int64)], dim=-1)
    return torch.cat([head, keys.topk(min(num_top, width), dim=-1).values], dim=-1)


def prompt_logprobs_with_exchange(exchange, target_ids: torch.Tensor, num_top: int,
                                  org_vocab_size: int) -> PromptLogprobs:
    """The protocol over ``exchange`` (see :mod:`tpguide.sampling.exchange`).

    One all-gather of :func:`local_prompt_candidates`, one all-reduce of the
    fixed-point ``sum(exp(x - max))``; every rank makes the same calls.
    """
    n = min(num_top, org_vocab_size)
    stacked = exchange.gather(lambda x, s: local_prompt_candidates(x, target_ids, s, n))  # [tp, rows, 3 + n_local]
    tp, rows, _ = stacked.shape
    max_key = stacked[:, :, 0].max(dim=0).values  # [rows]
    target_key = stacked[:, :, 1].max(dim=0).values  # [rows]: the one rank holding the target
    bad = stacked[:, :, 2].max(dim=0).values.bool()
    cands = stacked[:, :, _HEAD:].permute(1, 0, 2).reshape(rows, -1)  # [rows, tp * n_local]
    top = cands.topk(min(n, cands.shape[1]), dim=-1).values  # [rows, n]
    gmax = key_values(max_key)  # float64 [rows]
    bad |= ~torch.isfinite(gmax) | (target_key == _NO_KEY)
    gmax = torch.where(bad, 0.0, gmax)
    sums = exchange.reduce_sum(lambda x, s: fixed_point_exp_sum(x.to(torch.float64) - gmax.to(x.device)[:, None]))
    lse = gmax + torch.log(sums.to(torch.float64).clamp(min=1.0) / FIXED_ONE)  # [rows]
    target_x = key_values(torch.where(bad, 0, target_key))
    return PromptLogprobs(
        logprobs=torch.where(bad, float("-inf"), target_x - lse).to(torch.float32),
        top_ids=key_ids(top),
        top_logprobs=torch.where(bad[:, None], float("-inf"), key_values(top) - lse[:, None]).to(torch.float32),
    )


def prompt_logprobs_by_hand(logits_shards, target_ids: torch.Tensor, num_top: int, shards) -> PromptLogprobs:
    """:func:`tpguide.worker.group_sampling.compute_prompt_logprobs` for all ranks in one process (shard-by-hand tests)."""
    for x, s in zip(logits_shards, shards, strict=True):
        check_prompt_inputs(x, target_ids, num_top, s)
    return prompt_logprobs_with_exchange(ShardsByHand(logits_shards, shards), target_ids, num_top,
                                         shards[0].org_vocab_size)


def check_prompt_inputs(logits_shard: torch.Tensor, target_ids: torch.Tensor, num_top: int, shard: VocabShard) -> None:
    """Raise ``ValueError`` naming the shapes when one rank's prompt-logprob inputs do not fit."""
    want = (target_ids.shape[0], shard.num_embeddings_per_partition)
    if target_ids.dim() != 1 or tuple(logits_shard.shape) != want:
        raise ValueError(f"logits_shard must have shape {want} [rows, V_local] for target_ids of shape "
                         f"{tuple(target_ids.shape)}, got {tuple(logits_shard.shape)}")
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
