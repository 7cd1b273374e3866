"""Exact, TP-invariant sampling over a vocabulary-sharded logits tensor (docs/architecture.md §6).

Each rank holds ``logits_shard`` ``[rows, V_local]`` for global ids
``[vocab_start_index, vocab_end_index)`` and never sees the full row.  The
same request, seed and position give the same token (and bit-identical
logprobs) for tp_size 1, 2, 3, 4:

* **ranking keys.**  A token's (fp32 logit, global id) pair is packed into one
  int64 whose order is "larger logit first, lower id on ties" and that is
  unique per token (:func:`order_keys`).  Maxima and top-k selections of keys
  are therefore unambiguous, whatever the shard layout or the topk kernel.
* **greedy**: max key per rank, all-gathered, max wins.
* **temperature** (no top-k/top-p): Gumbel-max, ``argmax(logits / T + g)``
  with ``g`` from :mod:`tpguide.sampling.random_stream`, a pure function of
  ``(seed, sample_position, global_token_id)``; each rank sends its winner
  ``(score, key)``; max score wins, lowest id on ties.
* **top-k / top-p**: each rank sends its top ``min(K, V_local)`` keys; the
  merge keeps the global top ``K`` (identical for every tp_size); top-k keeps
  ranks ``< k``; top-p keeps the shortest prefix (in key order) whose mass
  under ``softmax(logits / T)`` reaches ``top_p`` (renormalised over the top-k
  set when both are on, as in vLLM); Gumbel-max on the kept set with the same
  noise.  ``K = max(top_k in batch, num_logprobs, TOP_P_CANDIDATES if a row
  uses top-p alone)``, capped at ``org_vocab_size``.
* **log-sum-exp**: global max from the gathered greedy keys, then
  ``sum(exp(x - max))`` as fixed-point int64 (``2**44`` units per unit of
  probability) all-reduced with ``op="sum"``; integer addition is
  associative, so the sum is the same for every partition.

Exactness conditions (each tested in ``tests/test_sampler.py``):

* top-k is exact: the global top-k lies in the union of the local top-k.
* top-p is exact when the nucleus lies inside the ``K`` merged candidates.
  This is *checked*, not assumed: if the candidates of a top-p-only row hold
  less than ``top_p`` of the mass (and more finite tokens exist), ``K`` grows
  by ``TOP_P_GROWTH`` and the candidates are gathered again, up to all
  ``org_vocab_size`` tokens.  Only that worst case (flat distributions) moves
  ``O(rows * vocab)`` bytes.
* Probabilities carry the fixed-point error of the sum, at most
  ``V * 2**-45`` relative (1.4e-9 at V=49152); this moves a top-p boundary
  only when a cumulative mass is that close to ``top_p`` and is the same on
  every tp_size.  The uniforms have 32-bit resolution.
* Padded ids (``>= org_vocab_size``) must already be ``-inf`` (docs/architecture.md §2);
  a row that would sample one is flagged in ``bad_rows``.
* Bit-identity across tp sizes also rests on elementwise ops (division,
  ``exp``, ``log``) giving an element the same result whatever the tensor's
  width or offset on one device type (checked on CPU/AVX2; CUDA evaluates
  every element with the same device function), and on every rank using the
  same device type.

Logprobs are those of ``log_softmax(logits)`` of the logits passed in, i.e.
after the grammar bitmask and padding ``-inf`` but *before* temperature,
top-k and top-p (vLLM's default ``raw_logprobs``).  A row that is all
``-inf``, or holds a NaN or ``+inf``, is flagged in ``bad_rows`` (token id
``-1``, logprob ``-inf``): it never turns into NaN silently.

Bytes moved per step, default model (SmolLM2-135M: hidden 576, 30 layers,
vocab 49152; tp 4, ``V_local`` 12288, bitmask 1536 int32 words per row), for
``R`` sample rows (= ``T`` tokens on a decode step), received per rank:

=======================================  ===========  ===========  ===============
what                                     R = 8        R = 32       per row
=======================================  ===========  ===========  ===============
sampler all-gather, greedy/temperature   1 KiB        4 KiB        ``32 * tp`` B
sampler all-gather, top-k 50             13.5 KiB     54 KiB       ``8 (4+K) tp`` B
sampler all-gather, top-p (K = 256)      65 KiB       260 KiB      8.1 KiB
sampler all-reduce (logprobs / top-p)    128 B        512 B        16 B
bitmask slice (scatter) + token_mask     12 KiB       48 KiB       1.5 KiB + 4 B
*full-logits gather (what we avoid)*     *1.5 MiB*    *6 MiB*      *192 KiB*
model all-reduces, fp32 (1 + 2 * 30)     1.07 MiB     4.3 MiB      137 KiB
=======================================  ===========  ===========  ===============

The sampler's all-reduce is skipped when no row wants logprobs and none uses
top-p alone (``return_logprobs=False``).  Prompt logprobs
(:mod:`tpguide.sampling.prompt_logprobs`) add ``8 * (3 + n) * tp + 8`` bytes
per prompt row.  The step plan (one ``broadcast_object``) is ``O(T)``
integers, a few KiB.  A guided greedy row thus costs about 1.7 KiB: 1.2% of
what the model's own activation all-reduces move per token (``576 * 4 * 61``
bytes) and 0.9% of a full-logits gather; a top-p row about 9.6 KiB (7%).
"""

from __future__ import annotations

from typing import Sequence

import torch

from tpguide.model.vocab_shard import VocabShard
from tpguide.sampling.candidates import (
    Merged,
    RowModes,
    key_ids,
    key_values,
    local_candidates,
    local_sum_exp,
    merge_candidates,
    num_candidates,
    row_modes,
)
from tpguide.sampling.exchange import ShardsByHand
from tpguide.sampling.metadata import (  # SamplingMetadata re-exported
    FIXED_ONE,
    ID_SPAN,
    MAX_VOCAB_SIZE,
    MIN_TEMPERATURE,
    TOP_P_GROWTH,
    SamplerOutput,
    SamplingMetadata,
)
from tpguide.sampling.random_stream import gumbel_noise


def _finish(merged: Merged, gmax: torch.Tensor, log_norm: torch.Tensor, meta: SamplingMetadata,
            org_vocab_size: int) -> tuple[SamplerOutput, torch.Tensor]:
    """Choose every row's token from the merged candidates (pure, same on every rank).

    Returns the output and ``needs_more`` bool [rows]: top-p-only rows whose
    nucleus may extend past the candidates.
    """
    device = gmax.device
    modes = RowModes(*(m.to(device) for m in row_modes(meta, org_vocab_size)))
    temp = meta.temperature.to(device, torch.float64).clamp(min=MIN_TEMPERATURE)
    token_key = torch.where(modes.plain, merged.gumbel_key, merged.max_key)
    token_ids, token_x = key_ids(token_key), key_values(token_key)
    needs_more = torch.zeros_like(modes.greedy)
    filt = (modes.top_k_on | modes.top_p_on).nonzero().squeeze(-1)
    if filt.numel():
        keys = merged.cand_keys[filt]  # [F, K], largest first
        cx, cid = key_values(keys), key_ids(keys)
        k_on, p_on = modes.top_k_on[filt], modes.top_p_on[filt]
        rank = torch.arange(keys.shape[1], device=device)
        k_eff = torch.where(k_on, meta.top_k.to(device, torch.int64)[filt], keys.shape[1])
        kept = (cx > float("-inf")) & (rank < k_eff[:, None])
        if bool(p_on.any()):
            d = (cx - gmax[filt, None]) / temp[filt, None]  # log-probs up to the normaliser
            in_topk = torch.logsumexp(torch.where(kept, d, float("-inf")), dim=-1)
            norm = torch.where(k_on, in_topk, log_norm[filt, 1])
            prob = torch.where(kept, torch.exp(d - norm[:, None]), 0.0)
            cum = prob.cumsum(dim=-1)
            before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
            top_p = meta.top_p.to(device, torch.float64)[filt]
            kept &= (before < top_p[:, None]) | ~p_on[:, None]
            short = p_on & ~k_on & (cum[:, -1] < top_p) & (cx[:, -1] > float("-inf"))
            needs_more[filt] = short & (keys.shape[1] < org_vocab_size)
        seeds, positions = meta.seeds.to(device)[filt], meta.sample_positions.to(device)[filt]
        noise = gumbel_noise(seeds, positions, cid)  # [F, K]
        score = torch.where(kept, cx / temp[filt, None] + noise, float("-inf"))
        tied = score == score.max(dim=-1, keepdim=True).values
        pick = torch.where(tied, cid, ID_SPAN).argmin(dim=-1, keepdim=True)  # lowest id on ties
        token_ids[filt] = cid.gather(-1, pick).squeeze(-1)
        token_x[filt] = cx.gather(-1, pick).squeeze(-1)
    lse = gmax + log_norm[:, 0]
    bad = merged.bad | ~torch.isfinite(key_values(merged.max_key)) | (token_ids >= org_vocab_size)
    n = min(meta.num_logprobs, merged.cand_keys.shape[1])
    top = merged.cand_keys[:, :n]
    out = SamplerOutput(
        token_ids=torch.where(bad, -1, token_ids),
        logprobs=torch.where(bad, float("-inf"), token_x - lse).to(torch.float32),
        top_logprob_ids=key_ids(top),
        top_logprobs=torch.where(bad[:, None], float("-inf"), key_values(top) - lse[:, None]).to(torch.float32),
        bad_rows=bad,
        num_candidates=merged.cand_keys.shape[1],
    )
    return out, needs_more


def sample_with_exchange(exchange, meta: SamplingMetadata, shard: VocabShard) -> SamplerOutput:
    """Sample one token per row from vocabulary-sharded logits; same result on every rank.

    ``exchange`` provides the two collectives (:mod:`tpguide.sampling.exchange`):
    :class:`~tpguide.worker.group_exchange.GroupExchange` over a real TP group
    (:func:`tpguide.worker.group_exchange.sample`) or
    :class:`~tpguide.sampling.exchange.ShardsByHand` in one process.  Logits
    shards are float32 (fp16/bf16 upcast exactly) ``[rows, V_local]``, bitmask
    applied, padded ids ``-inf``, not modified; the result is on their device.

    Every rank makes the same calls in the same order: gather candidates,
    all-reduce the fixed-point sums, and (rarely) gather more candidates.
    """
    org = shard.org_vocab_size
    k = num_candidates(meta, org)
    merged = merge_candidates(exchange.gather(lambda x, s: local_candidates(x, meta, s, k)), k)
    gmax = key_values(merged.max_key)
    gmax = torch.where(torch.isfinite(gmax), gmax, 0.0)
    inv_t = 1.0 / meta.temperature.to(gmax.device, torch.float64).clamp(min=MIN_TEMPERATURE)
    modes = row_modes(meta, org)
    top_p_only = (modes.top_p_on & ~modes.top_k_on).nonzero().squeeze(-1).to(gmax.device)  # log_norm[:, 1] users
    want_lse = meta.return_logprobs or meta.num_logprobs > 0
    if want_lse or top_p_only.numel():  # the same decision on every rank
        sums = exchange.reduce_sum(lambda x, s: local_sum_exp(x, gmax, inv_t, top_p_only, plain_sum=want_lse))
        log_norm = torch.log(sums.to(torch.float64).clamp(min=1.0) / FIXED_ONE)  # [rows, 2]
    else:
        log_norm = gmax.new_zeros((gmax.shape[0], 2))
    if not want_lse:
        log_norm[:, 0] = float("nan")
    out, needs_more = _finish(merged, gmax, log_norm, meta, org)
    while bool(needs_more.any()):  # same decision on every rank: the inputs are identical
        k = min(k * TOP_P_GROWTH, org)
        merged = merge_candidates(exchange.gather(lambda x, s: local_candidates(x, meta, s, k)), k)
        out, needs_more = _finish(merged, gmax, log_norm, meta, org)
    return out


def check_sampler_inputs(logits_shard: torch.Tensor, meta: SamplingMetadata, shard: VocabShard) -> None:
    """Raise ``ValueError``/``TypeError`` naming the values when one rank's sampler inputs do not fit."""
    if shard.padded_vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(f"padded_vocab_size={shard.padded_vocab_size} > {MAX_VOCAB_SIZE} (fixed-point sum)")
    want = (meta.num_rows, shard.num_embeddings_per_partition)
    if tuple(logits_shard.shape) != want:
        raise ValueError(f"logits_shard must have shape {want} [rows, V_local], got {tuple(logits_shard.shape)}")
    if not logits_shard.is_floating_point():
        raise TypeError(f"logits_shard must be floating point, got {logits_shard.dtype}")
    if meta.num_logprobs > shard.org_vocab_size:
        raise ValueError(f"num_logprobs={meta.num_logprobs} > org_vocab_size={shard.org_vocab_size}")


def sample_by_hand(
    logits_shards: Sequence[torch.Tensor], meta: SamplingMetadata, shards: Sequence[VocabShard]
) -> SamplerOutput:
    """:func:`sample_with_exchange` for all ranks in one process (stack instead of all-gather).

    The single-process oracle of shard-by-hand tests: ``logits_shards[r]`` and
    ``shards[r]`` are rank ``r``'s inputs.
    """
    for x, s in zip(logits_shards, shards, strict=True):
        check_sampler_inputs(x, meta, s)
    return sample_with_exchange(ShardsByHand(logits_shards, shards), meta, shards[0])
