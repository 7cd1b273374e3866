"""One rank's sampling candidates and their merge: pure functions, no collectives.

Each (fp32 logit, global token id) pair is packed into one int64 *key*
whose order is "larger logit first, lower id on ties", so greedy, top-k and
top-n never depend on ``torch.topk``'s tie-breaking.  :func:`local_candidates`
builds one rank's all-gather payload, :func:`merge_candidates` merges the
stacked payloads identically on every rank, :func:`local_sum_exp` and
:func:`fixed_point_exp_sum` give the tp-invariant log-sum-exp.  The
protocol around them is in :mod:`tpguide.sampling.sampler`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from tpguide.model.vocab_shard import VocabShard
from tpguide.sampling.metadata import (
    FIXED_ONE,
    ID_SPAN,
    MIN_TEMPERATURE,
    NUM_HEAD_COLS,
    TOP_P_CANDIDATES,
    SamplingMetadata,
)
from tpguide.sampling.random_stream import gumbel_noise


class RowModes(NamedTuple):
    greedy: torch.Tensor  # bool [rows], CPU
    top_k_on: torch.Tensor
    top_p_on: torch.Tensor
    plain: torch.Tensor  # temperature sampling without top-k/top-p


def row_modes(meta: SamplingMetadata, org_vocab_size: int) -> RowModes:
    greedy = meta.temperature.cpu() < MIN_TEMPERATURE
    top_k = meta.top_k.cpu()
    k_on = (top_k >= 1) & (top_k < org_vocab_size) & ~greedy
    p_on = (meta.top_p.cpu() < 1) & ~greedy
    return RowModes(greedy, k_on, p_on, ~greedy & ~k_on & ~p_on)


def num_candidates(meta: SamplingMetadata, org_vocab_size: int) -> int:
    """First-round candidate count ``K`` for a batch (see module docstring)."""
    modes = row_modes(meta, org_vocab_size)
    k = meta.num_logprobs
    if bool(modes.top_k_on.any()):
        k = max(k, int(meta.top_k.cpu()[modes.top_k_on].max()))
    if bool((modes.top_p_on & ~modes.top_k_on).any()):
        k = max(k, TOP_P_CANDIDATES)
    return min(k, org_vocab_size)


def order_keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered by (fp32 value ascending, id descending); unique per id.

    The fp32 bit pattern is made monotone (flip the magnitude bits of
    negatives, the radix-sort trick) and placed above ``2**32 - 1 - id``.
    ``values`` must be fp32 with ``-0.0`` already turned into ``+0.0``.
    """
    bits = values.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered * ID_SPAN + (ID_SPAN - 1 - ids)


def key_ids(keys: torch.Tensor) -> torch.Tensor:
    return (ID_SPAN - 1) - (keys & (ID_SPAN - 1))


def key_values(keys: torch.Tensor) -> torch.Tensor:
    """fp32 values of :func:`order_keys` keys, returned as float64 (exact)."""
    ordered = keys >> 32
    bits = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return bits.to(torch.int32).view(torch.float32).to(torch.float64)


def local_candidates(
    logits_shard: torch.Tensor, meta: SamplingMetadata, shard: VocabShard, num_candidates: int
) -> torch.Tensor:
    """One rank's packed sampling candidates (pure; the all-gather payload).

    Parameters
    ----------
    logits_shard : Tensor, float [rows, V_local]
        This rank's logits (bitmask applied); not modified.
    meta : SamplingMetadata
    shard : VocabShard
        Gives ``vocab_start_index`` (global id of column 0) and ``org_vocab_size``.
    num_candidates : int
        ``K``; the rank sends its top ``min(K, V_local)`` keys.

    Returns
    -------
    Tensor, int64 [rows, 4 + min(K, V_local)]
        Columns: max key; Gumbel score (float64 bits; the max logit on rows
        that are not plain temperature rows); key of the Gumbel winner; 1 if
        the row holds a NaN or ``+inf``; then the top keys, largest first.
    """
    x = logits_shard.to(torch.float32) + 0.0  # [rows, V_local]; -0.0 -> +0.0
    rows, width = x.shape
    start = shard.vocab_start_index
    ids = torch.arange(start, start + width, device=x.device)
    # max and its first index = the max key (larger value, then lower id); NaN propagates
    row_max, first = x.max(dim=-1)  # [rows]
    max_key = order_keys(row_max, first + start)
    bad = torch.isnan(row_max) | (row_max == float("inf"))
    # rows that are not plain temperature rows carry the greedy pair here (no noise)
    score, winner_key = key_values(max_key), max_key.clone()
    plain = row_modes(meta, shard.org_vocab_size).plain.nonzero().squeeze(-1).to(x.device)
    if plain.numel():
        temp = meta.temperature.to(x.device, torch.float64)[plain]
        seeds, positions = meta.seeds.to(x.device)[plain], meta.sample_positions.to(x.device)[plain]
        noise = gumbel_noise(seeds, positions, ids)  # [P, V_local]
        s = x[plain].to(torch.float64) / temp[:, None] + noise
        best = s.argmax(dim=-1, keepdim=True)  # first maximum = lowest id on ties
        score[plain] = s.gather(-1, best).squeeze(-1)
        winner_key[plain] = order_keys(x[plain].gather(-1, best).squeeze(-1), best.squeeze(-1) + start)
    k = min(num_candidates, width)
    if k:  # full-row keys only when candidates are wanted: [rows, V_local] int64
        top = order_keys(x, ids).topk(k, dim=-1).values  # sorted, largest first
    else:
        top = max_key.new_empty((rows, 0))
    head = torch.stack([max_key, score.view(torch.int64), winner_key, bad.to(torch.int64)], dim=-1)
    return torch.cat([head, top], dim=-1)


class Merged(NamedTuple):
    """Global candidates after :func:`merge_candidates` (identical on every rank)."""

    max_key: torch.Tensor  # int64 [rows]: greedy winner
    gumbel_key: torch.Tensor  # int64 [rows]: plain temperature winner
    bad: torch.Tensor  # bool [rows]
    cand_keys: torch.Tensor  # int64 [rows, min(K, tp * V_local)], largest first


def merge_candidates(stacked: torch.Tensor, num_candidates: int) -> Merged:
    """Merge every rank's :func:`local_candidates` (pure).

    Parameters
    ----------
    stacked : Tensor, int64 [tp_size, rows, 4 + K_local]
        Rank ``r``'s payload in row ``r`` (from ``all_gather_stacked``).
    num_candidates : int
        ``K`` to keep (at most ``tp_size * K_local``).
    """
    tp, rows, _ = stacked.shape
    scores = stacked[:, :, 1].view(torch.float64)  # [tp, rows]
    g_keys = stacked[:, :, 2]
    tied = scores == scores.max(dim=0, keepdim=True).values
    # among the ranks with the best score, the one whose winner has the lowest id
    tie_ids = torch.where(tied, key_ids(g_keys), ID_SPAN)
    src = tie_ids.argmin(dim=0, keepdim=True)  # [1, rows]
    cands = stacked[:, :, NUM_HEAD_COLS:].permute(1, 0, 2).reshape(rows, tp * (stacked.shape[2] - NUM_HEAD_COLS))
    return Merged(
        max_key=stacked[:, :, 0].max(dim=0).values,
        gumbel_key=g_keys.gather(0, src).squeeze(0),
        bad=stacked[:, :, 3].max(dim=0).values.bool(),
        cand_keys=cands.topk(min(num_candidates, cands.shape[1]), dim=-1).values,
    )


def local_sum_exp(logits_shard: torch.Tensor, gmax: torch.Tensor, inv_temperature: torch.Tensor,
                  scaled_rows: Optional[torch.Tensor] = None, plain_sum: bool = True) -> torch.Tensor:
    """Fixed-point ``sum(exp(x - gmax))`` and ``sum(exp((x - gmax) / T))`` of one rank (pure).

    Parameters
    ----------
    logits_shard : Tensor, float [rows, V_local]
    gmax : Tensor, float64 [rows]
        Global max logit (finite; 0 on bad rows).
    inv_temperature : Tensor, float64 [rows]
    scaled_rows : Tensor, int64 [S], optional
        Rows whose second sum is wanted (default: all); the others get 0
        there (the sampler needs it for top-p-only rows alone).
    plain_sum : bool
        Compute the first sum (else 0: no logprobs wanted).

    Returns
    -------
    Tensor, int64 [rows, 2]
        Sums in units of ``2**-44``; add them over ranks.
    """
    d = logits_shard.to(torch.float64) - gmax[:, None]  # <= 0 on good rows
    out = torch.zeros((d.shape[0], 2), dtype=torch.int64, device=d.device)
    if plain_sum:
        out[:, 0] = fixed_point_exp_sum(d)
    if scaled_rows is None:
        out[:, 1] = fixed_point_exp_sum(d * inv_temperature[:, None])
    elif scaled_rows.numel():
        out[scaled_rows, 1] = fixed_point_exp_sum(d[scaled_rows] * inv_temperature[scaled_rows, None])
    return out


def fixed_point_exp_sum(d: torch.Tensor) -> torch.Tensor:
    """``sum(exp(d), dim=-1)`` in int64 units of ``2**-44`` (pure; add the results over ranks).

    Parameters
    ----------
    d : Tensor, float64 [rows, V_local]
        Logits minus the global row max (``<= 0``; NaN / ``+inf`` only on bad
        rows, where they count as 0).

    Returns
    -------
    Tensor, int64 [rows]
        Integer addition is associative, so the total over ranks does not
        depend on how the vocabulary is split (docs/architecture.md §6).
    """
    e = torch.exp(d)
    e = torch.where(e <= 1.0, e, 0.0)  # NaN / inf only on bad rows
    return torch.round(e * FIXED_ONE).to(torch.int64).sum(dim=-1)
