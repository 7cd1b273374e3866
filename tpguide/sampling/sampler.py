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

Batch invariance on the CUDA code path (docs/gpu.md, "Exactness on CUDA"):
max, argmax and top-k of unique integer keys are exact, and the fixed-point
sums add integers, so those do not depend on the other rows; the two float
reductions over the candidates, the top-k set's log-sum-exp and the top-p
cumulative sum, run a per-row Triton kernel in a fixed order there
(:mod:`tpguide.kernels.row_reductions_triton`), torch's elsewhere.  Which
rows are greedy, filtered or top-p, and ``K``, come from the metadata's host
copy (:attr:`SamplingMetadata.host`), never from device values.

Logprobs are those of ``log_softmax(logits)`` of the logits passed in, i.e.
after penalties, ``logit_bias``, the grammar bitmask and padding ``-inf`` but
*before* temperature, top-k and top-p (docs/exactness.md; vLLM's default
``logprobs_mode``, ``raw_logprobs``, is taken before penalties and
``logit_bias`` as well).  A row that is all
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

The file holds, in order: the sampler's per-row parameters and its output
(:class:`SamplingMetadata`, :class:`SamplerOutput`, the constants); one
rank's candidates and their merge, pure functions without collectives
(:func:`local_candidates` builds one rank's all-gather payload,
:func:`merge_candidates` merges the stacked payloads identically on every
rank, :func:`local_sum_exp` and :func:`fixed_point_exp_sum` give the
tp-invariant log-sum-exp); then the protocol around them
(:func:`sample_with_exchange`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence

import torch

from tpguide.kernels.triton_path import use_triton
from tpguide.model.vocab_shard import VocabShard
from tpguide.sampling.exchange import ShardsByHand
from tpguide.sampling.random_stream import gumbel_noise

if TYPE_CHECKING:
    from tpguide.sampling.penalties import LogitPenalties


# ------------------------------------------------------------- parameters and output

#: Candidates per rank for rows that use top-p without top-k (first round).
TOP_P_CANDIDATES = 256
#: Factor by which the candidate count grows when a nucleus does not fit.
TOP_P_GROWTH = 8
#: Temperatures below this are greedy (vLLM's sampling epsilon).
MIN_TEMPERATURE = 1e-5
FIXED_ONE = 2.0**44  # fixed-point unit of sum_exp; 2**19 tokens * 2**44 < 2**63
MAX_VOCAB_SIZE = 2**19
ID_SPAN = 2**32
NUM_HEAD_COLS = 4  # greedy key, Gumbel score bits, Gumbel key, bad flag; then K candidate keys


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling parameters of one step (rows = sample rows, CPU or device).

    Attributes
    ----------
    temperature : Tensor, float32 [rows]
        ``>= 0``; below :data:`MIN_TEMPERATURE` means greedy.
    top_k : Tensor, int32 [rows]
        ``0`` or ``-1`` = off; ``>= org_vocab_size`` is off too.
    top_p : Tensor, float32 [rows]
        In ``(0, 1]``; ``1`` = off.
    seeds : Tensor, int64 [rows]
        Seed of each row's request (any 64-bit value).
    sample_positions : Tensor, int64 [rows]
        Absolute position of the token each row produces (tokens, ``>= 0``).
    num_logprobs : int
        Top-n logprobs to return per row (max over the batch); 0 = none.
    penalties : LogitPenalties or None
        Sparse penalties and logit biases, applied to each rank's logits
        shard before masking and sampling (:mod:`tpguide.sampling.penalties`).
    return_logprobs : bool
        Compute :attr:`SamplerOutput.logprobs` (forced on when ``num_logprobs > 0``).
        When off and no row uses top-p alone, the log-sum-exp pass over the
        vocabulary and its all-reduce are skipped, and ``logprobs`` is NaN.
    host : SamplingMetadata or None
        The CPU original of a copy made by :meth:`to` (None on the original):
        the sampler takes its decisions (row modes, the candidate count, which
        rows to filter) from it, so a device copy's values are never read back
        to the host (docs/gpu.md, "Exactness on CUDA").  A copy is not validated again.

    Raises
    ------
    ValueError, TypeError
        Wrong shapes, dtypes or out-of-range values (the message names them).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    sample_positions: torch.Tensor
    num_logprobs: int = 0
    return_logprobs: bool = True
    penalties: Optional["LogitPenalties"] = None
    host: Optional["SamplingMetadata"] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.host is not None:  # a copy of validated metadata: no value reads on its device
            return
        rows = self.temperature.shape
        for name, dtypes in (("temperature", (torch.float32,)), ("top_k", (torch.int32, torch.int64)),
                             ("top_p", (torch.float32,)), ("seeds", (torch.int64,)),
                             ("sample_positions", (torch.int64,))):
            t = getattr(self, name)
            if t.dtype not in dtypes:
                raise TypeError(f"{name} must have dtype in {dtypes}, got {t.dtype}")
            if t.dim() != 1 or t.shape != rows:
                raise ValueError(f"{name} must be 1-D of shape {tuple(rows)}, got {tuple(t.shape)}")
        if not bool(((self.temperature >= 0) & torch.isfinite(self.temperature)).all()):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature.tolist()}")
        if not bool(((self.top_p > 0) & (self.top_p <= 1)).all()):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p.tolist()}")
        if not bool((self.top_k >= -1).all()):
            raise ValueError(f"top_k must be >= -1 (0 or -1 = off), got {self.top_k.tolist()}")
        if not bool((self.sample_positions >= 0).all()):
            raise ValueError(f"sample_positions must be >= 0, got {self.sample_positions.tolist()}")
        if self.num_logprobs < 0:
            raise ValueError(f"num_logprobs must be >= 0, got {self.num_logprobs}")

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def on_host(self) -> "SamplingMetadata":
        """The metadata whose tensors are on the CPU: :attr:`host`, or ``self`` when it is the original."""
        return self if self.host is None else self.host

    def to(self, device: torch.device | str) -> "SamplingMetadata":
        """A copy with every tensor on ``device`` (not in place), remembering the CPU original (:attr:`host`)."""
        moved = {f: getattr(self, f).to(device) for f in ("temperature", "top_k", "top_p", "seeds", "sample_positions")}
        penalties = self.penalties.to(device) if self.penalties is not None else None
        host = self.on_host if self.on_host.temperature.device.type == "cpu" else None
        return SamplingMetadata(**moved, num_logprobs=self.num_logprobs, return_logprobs=self.return_logprobs,
                                penalties=penalties, host=host)


@dataclass(frozen=True)
class SamplerOutput:
    """Sampling result, identical on every rank (same device as the logits).

    Attributes
    ----------
    token_ids : Tensor, int64 [rows]
        Sampled global token ids; ``-1`` on bad rows.
    logprobs : Tensor, float32 [rows]
        ``log_softmax(logits)`` of the sampled token (raw, see module docstring).
    top_logprob_ids, top_logprobs : Tensor, int64 / float32 [rows, num_logprobs]
        The ``num_logprobs`` most likely tokens, larger logit first, lower id on ties.
    bad_rows : Tensor, bool [rows]
        All ``-inf``, a NaN or ``+inf`` in the row, or a padded id won: fail that request.
    num_candidates : int
        Candidates gathered per rank in the last round (diagnostics; 0 = none).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_logprob_ids: torch.Tensor
    top_logprobs: torch.Tensor
    bad_rows: torch.Tensor
    num_candidates: int


# ------------------------------------------------------------- one rank's candidates (pure)

class RowModes(NamedTuple):
    greedy: torch.Tensor  # bool [rows], CPU
    top_k_on: torch.Tensor
    top_p_on: torch.Tensor
    plain: torch.Tensor  # temperature sampling without top-k/top-p


def row_modes(meta: SamplingMetadata, org_vocab_size: int) -> RowModes:
    """Each row's sampling mode, bool ``[rows]`` on the CPU, from the host copy (:attr:`SamplingMetadata.on_host`).

    Computed once per metadata and vocabulary size (about 12 small CPU ops,
    ~30 us; a step asks 4 times) and kept on the host copy, whose tensors a
    step never changes.
    """
    meta = meta.on_host
    cache = meta.__dict__.setdefault("_row_modes", {})  # a frozen dataclass still has its __dict__
    modes = cache.get(org_vocab_size)
    if modes is None:
        greedy = meta.temperature.cpu() < MIN_TEMPERATURE
        top_k = meta.top_k.cpu()
        k_on = (top_k >= 1) & (top_k < org_vocab_size) & ~greedy
        p_on = (meta.top_p.cpu() < 1) & ~greedy
        modes = cache[org_vocab_size] = RowModes(greedy, k_on, p_on, ~greedy & ~k_on & ~p_on)
    return modes


def num_candidates(meta: SamplingMetadata, org_vocab_size: int) -> int:
    """First-round candidate count ``K`` for a batch (see module docstring)."""
    modes = row_modes(meta, org_vocab_size)
    k = meta.num_logprobs
    if bool(modes.top_k_on.any()):
        k = max(k, int(meta.on_host.top_k.cpu()[modes.top_k_on].max()))  # host data: no device sync
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
    plain = row_modes(meta, shard.org_vocab_size).plain.nonzero().squeeze(-1).to(x.device, non_blocking=True)
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


# ------------------------------------------------------------- the protocol over an exchange

def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(x, dim=-1)``; on the CUDA path a fixed-order Triton kernel (batch-invariant)."""
    if use_triton(x):
        from tpguide.kernels.row_reductions_triton import logsumexp_rows

        return logsumexp_rows(x)
    return torch.logsumexp(x, dim=-1)


def _cumsum(x: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(dim=-1)``; on the CUDA path a fixed-order Triton kernel (batch-invariant)."""
    if use_triton(x):
        from tpguide.kernels.row_reductions_triton import cumsum_rows

        return cumsum_rows(x)
    return x.cumsum(dim=-1)


def _finish(merged: Merged, gmax: torch.Tensor, log_norm: torch.Tensor, meta: SamplingMetadata,
            org_vocab_size: int) -> tuple[SamplerOutput, torch.Tensor]:
    """Choose every row's token from the merged candidates (pure, same on every rank).

    Returns the output and ``needs_more`` bool [rows]: top-p-only rows whose
    nucleus may extend past the candidates.
    """
    device = gmax.device
    host_modes = row_modes(meta, org_vocab_size)  # decisions from host data: no device sync
    # host -> device copies are non-blocking: a blocking one is a stream sync (docs/gpu.md, "Speed on CUDA")
    modes = RowModes(*(m.to(device, non_blocking=True) for m in host_modes))
    temp = meta.temperature.to(device, torch.float64).clamp(min=MIN_TEMPERATURE)
    token_key = torch.where(modes.plain, merged.gumbel_key, merged.max_key)
    token_ids, token_x = key_ids(token_key), key_values(token_key)
    needs_more = torch.zeros_like(modes.greedy)
    filt_host = (host_modes.top_k_on | host_modes.top_p_on).nonzero().squeeze(-1)
    filt = filt_host.to(device, non_blocking=True)
    if filt_host.numel():
        keys = merged.cand_keys[filt]  # [F, K], largest first
        cx, cid = key_values(keys), key_ids(keys)
        k_on, p_on = modes.top_k_on[filt], modes.top_p_on[filt]
        rank = torch.arange(keys.shape[1], device=device)
        k_eff = torch.where(k_on, meta.top_k.to(device, torch.int64)[filt], keys.shape[1])
        kept = (cx > float("-inf")) & (rank < k_eff[:, None])
        if bool(host_modes.top_p_on[filt_host].any()):
            d = (cx - gmax[filt, None]) / temp[filt, None]  # log-probs up to the normaliser
            in_topk = _logsumexp(torch.where(kept, d, float("-inf")))
            norm = torch.where(k_on, in_topk, log_norm[filt, 1])
            prob = torch.where(kept, torch.exp(d - norm[:, None]), 0.0)
            cum = _cumsum(prob)
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
    :class:`~tpguide.worker.group_sampling.GroupExchange` over a real TP group
    (:func:`tpguide.worker.group_sampling.sample`) or
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
    # the rows that use log_norm[:, 1]
    top_p_only = (modes.top_p_on & ~modes.top_k_on).nonzero().squeeze(-1).to(gmax.device, non_blocking=True)
    want_lse = meta.return_logprobs or meta.num_logprobs > 0
    if want_lse or top_p_only.numel():  # the same decision on every rank
        sums = exchange.reduce_sum(lambda x, s: local_sum_exp(x, gmax, inv_t, top_p_only, plain_sum=want_lse))
        log_norm = torch.log(sums.to(torch.float64).clamp(min=1.0) / FIXED_ONE)  # [rows, 2]
    else:
        log_norm = gmax.new_zeros((gmax.shape[0], 2))
    if not want_lse:
        log_norm[:, 0] = float("nan")
    out, needs_more = _finish(merged, gmax, log_norm, meta, org)
    while top_p_only.numel() and bool(needs_more.any()):  # the same decision on every rank; read only for top-p rows
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
