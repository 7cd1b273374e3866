"""Draft head: the target's first ``L`` layers + a pruned, vocab-parallel draft LM head (docs/architecture.md §3).

A self-speculative drafter ("layer skip": Zhang et al. 2023, *Draft &
Verify*; Elhoushi et al. 2024, *LayerSkip*): the first ``num_layers`` decoder
layers of the target (shared weights and shared KV cache; a layer ``< L``
computes the same keys and values the target would, so the target's
verification simply overwrites them), the target's final norm, and an LM head
over ``draft_vocab_size`` target ids only.  Its rows are the target's LM-head
rows of those ids.  Optionally a tuned-lens translator (an affine map fitted
on calibration text, :mod:`tpguide.speculative.draft_lens`) sits between layer
``L`` and the final norm.

**Draft vocabulary.**  :func:`select_draft_vocab` keeps the first ``N`` ids
plus every stop token.  Byte-level BPE vocabularies (SmolLM2, Llama, GPT-2)
number their tokens in merge order, and merges are learnt most-frequent
first, so the first ids are the bytes and the most frequent merges of the
tokenizer's training corpus.  ``d2t`` is int32 ``[draft_vocab_size]`` of
offsets, ``target_id = draft_id + d2t[draft_id]``.

**Sharding.**  Like the target LM head the draft head is vocab-parallel: rank
``r`` holds draft ids ``[r*Dv/T, (r+1)*Dv/T)`` of the padded draft vocabulary
(``Dv`` rounded up to a multiple of ``tp_size``; padded draft ids have zero
rows, ``d2t`` 0 and ``-inf`` logits) and its slice of ``d2t``::

    draft ids      0 ............ Dv/T ............ 2Dv/T ... Dv_pad
    rank 0 rows    [ d2t[0:Dv/T] -> target ids anywhere in 0..V )
    rank 1 rows                    [ d2t[Dv/T:2Dv/T] -> anywhere )

so a shard's target ids are scattered over the whole target vocabulary: the
guided mask of a draft shard reads the **full** bitmask row and indexes
``d2t`` with the **global** draft id (:func:`apply_draft_bitmask_inplace`).
Greedy drafting is a vocab-parallel argmax over the draft shards
(:func:`draft_greedy`), mapped to target ids through ``d2t``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tpguide.dist import TPGroup
from tpguide.dist import group as collectives
from tpguide.kernels import apply_token_bitmask_inplace
from tpguide.model.weight_slice import Loadable, check_shape


def select_draft_vocab(org_vocab_size: int, draft_vocab_size: int, always: Iterable[int] = ()) -> List[int]:
    """Sorted target ids of the draft vocabulary: the first ids, plus ``always`` (stop tokens).

    Raises
    ------
    ValueError
        ``draft_vocab_size`` outside ``[len(always), org_vocab_size]``.
    """
    extra = sorted({int(t) for t in always})
    if not len(extra) <= draft_vocab_size <= org_vocab_size:
        raise ValueError(f"draft_vocab_size must be in [{len(extra)}, {org_vocab_size}], got {draft_vocab_size}")
    ids = set(extra)
    nxt = 0
    while len(ids) < draft_vocab_size:
        ids.add(nxt)
        nxt += 1
    return sorted(ids)


def build_d2t(target_ids: Sequence[int]) -> torch.Tensor:
    """int32 ``[len(target_ids)]`` offsets: ``target_ids[g] = g + d2t[g]``."""
    ids = torch.as_tensor(list(target_ids), dtype=torch.int64)
    return (ids - torch.arange(ids.numel())).to(torch.int32)


@dataclass(frozen=True)
class DraftVocabShard:
    """This rank's half-open slice ``[draft_vocab_start_index, draft_vocab_end_index)`` of the padded draft vocab."""

    draft_vocab_size: int
    padded_draft_vocab_size: int
    tp_rank: int
    tp_size: int
    draft_vocab_start_index: int
    draft_vocab_end_index: int

    @classmethod
    def create(cls, draft_vocab_size: int, tp_rank: int, tp_size: int) -> "DraftVocabShard":
        if draft_vocab_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"bad draft shard: draft_vocab_size={draft_vocab_size}, rank {tp_rank} of {tp_size}")
        padded = -(-draft_vocab_size // tp_size) * tp_size
        per = padded // tp_size
        return cls(draft_vocab_size, padded, tp_rank, tp_size, tp_rank * per, (tp_rank + 1) * per)

    def __post_init__(self) -> None:
        per = self.padded_draft_vocab_size // self.tp_size
        assert self.padded_draft_vocab_size % self.tp_size == 0, (self.padded_draft_vocab_size, self.tp_size)
        assert self.draft_vocab_end_index - self.draft_vocab_start_index == per

    @property
    def num_per_partition(self) -> int:
        return self.draft_vocab_end_index - self.draft_vocab_start_index

    @property
    def num_valid_per_partition(self) -> int:
        """Columns of this shard that are real draft ids (the rest is padding)."""
        return max(0, min(self.num_per_partition, self.draft_vocab_size - self.draft_vocab_start_index))


class DraftLMHead(nn.Module):
    """Vocab-parallel LM head over a pruned draft vocabulary.

    Parameters
    ----------
    target_ids : sequence of int
        Sorted distinct target ids of the draft vocabulary (draft id = index).
    hidden_size : int
    org_vocab_size : int
        Rows of the target checkpoint's LM head (for the shape check).
    group : TPGroup
    dtype : torch.dtype

    Attributes
    ----------
    shard : DraftVocabShard
    weight : ``[num_per_partition, hidden_size]``; padded rows zero.
    d2t : Tensor, int32 ``[num_per_partition]``
        This rank's slice of the offsets (padded entries 0).
    """

    def __init__(self, target_ids: Sequence[int], hidden_size: int, org_vocab_size: int, group: TPGroup,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        ids = list(target_ids)
        if ids != sorted(set(ids)) or not ids or ids[0] < 0 or ids[-1] >= org_vocab_size:
            raise ValueError(f"target_ids must be sorted, distinct and in [0, {org_vocab_size})")
        self.group, self.hidden_size, self.org_vocab_size = group, hidden_size, org_vocab_size
        self.shard = DraftVocabShard.create(len(ids), group.tp_rank, group.tp_size)
        s = self.shard
        full = torch.zeros(s.padded_draft_vocab_size, dtype=torch.int32)
        full[: len(ids)] = build_d2t(ids)
        self.register_buffer("d2t", full[s.draft_vocab_start_index : s.draft_vocab_end_index].to(group.device),
                             persistent=False)
        self._target_ids = torch.tensor(ids[s.draft_vocab_start_index : s.draft_vocab_end_index], dtype=torch.int64)
        self.weight = nn.Parameter(torch.zeros(s.num_per_partition, hidden_size, dtype=dtype, device=group.device),
                                   requires_grad=False)

    def load_target_lm_head(self, loaded: Loadable) -> None:
        """Copy this shard's rows from the target LM head ``[org_vocab_size, hidden_size]`` (tensor or safetensors slice)."""
        check_shape(loaded, (self.org_vocab_size, self.hidden_size))
        if self._target_ids.numel() == 0:
            return
        lo, hi = int(self._target_ids[0]), int(self._target_ids[-1]) + 1
        rows = loaded[lo:hi]  # one contiguous read, then pick the draft rows
        self.weight.data[: self._target_ids.numel()] = rows[self._target_ids - lo].to(self.weight.dtype)

    @torch.no_grad()
    def compute_draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[R, hidden_size]`` -> fp32 draft logits shard ``[R, num_per_partition]``; padded ids ``-inf``."""
        logits = F.linear(hidden_states, self.weight).float()
        if self.shard.num_valid_per_partition < logits.size(1):
            logits[:, self.shard.num_valid_per_partition :] = float("-inf")
        return logits


def apply_draft_bitmask_inplace(draft_logits: torch.Tensor, token_bitmask: torch.Tensor, head: DraftLMHead,
                                token_mask: Optional[torch.Tensor] = None) -> None:
    """Mask a draft logits shard with **full** target bitmask rows, in place.

    Parameters
    ----------
    draft_logits : Tensor, fp32 ``[R, num_per_partition]``
    token_bitmask : Tensor, int32 ``[R, bitmask_size]``
        Full target rows (broadcast to every rank, not scattered).
    head : DraftLMHead
        Supplies ``d2t`` (local slice) and ``draft_vocab_start_index``.
    token_mask : Tensor, int32 ``[R]``, optional
    """
    apply_token_bitmask_inplace(draft_logits, token_bitmask, token_mask=token_mask, d2t=head.d2t,
                                draft_vocab_start_index=head.shard.draft_vocab_start_index)


def draft_greedy(draft_logits: torch.Tensor, head: DraftLMHead) -> torch.Tensor:
    """Vocab-parallel argmax over draft shards, as **target** ids; identical on every rank.

    Each rank sends ``(max value, global draft id, target id)`` of its shard;
    the max wins, the lowest draft id on ties (as the unsharded argmax).  A
    row that is ``-inf`` everywhere (the grammar allows no draft id) gives -1.

    Returns
    -------
    Tensor, int64 ``[R]``
    """
    value, local = draft_logits.max(dim=-1)  # [R], [R]; first max = lowest id on ties
    draft_id = local + head.shard.draft_vocab_start_index
    target_id = draft_id + head.d2t[local].to(torch.int64)
    mine = torch.stack([value.double(), draft_id.double(), target_id.double()], dim=-1)  # [R, 3]
    every = collectives.all_gather_stacked(mine, head.group)  # [T, R, 3]
    best_value = every[..., 0].max(dim=0).values  # [R]
    tie_ids = torch.where(every[..., 0] == best_value, every[..., 1], float("inf"))  # [T, R]
    winner = tie_ids.argmin(dim=0)  # [R]
    target = every[..., 2].gather(0, winner[None]).squeeze(0).to(torch.int64)
    return torch.where(torch.isinf(best_value) & (best_value < 0), torch.full_like(target, -1), target)


class DraftHead(nn.Module):
    """The first ``num_layers`` layers of ``target`` + an optional lens + its final norm + a :class:`DraftLMHead`.

    Parameters
    ----------
    target : LlamaForCausalLM
        This rank's target shard (layers and KV cache are shared, not copied).
    num_layers : int
        ``1 <= L <= num_hidden_layers``.
    lm_head : DraftLMHead
    lens : torch.Tensor, optional
        float32 ``[H + 1, H]`` affine translator of the residual after layer
        ``L`` (last row the bias), the same on every rank
        (:mod:`tpguide.speculative.draft_lens`); None = identity.

    Raises
    ------
    ValueError
        ``num_layers`` out of range; a lens of the wrong shape or dtype, or
        with ``L == num_hidden_layers`` (the residual already is the last one).
    """

    def __init__(self, target, num_layers: int, lm_head: DraftLMHead, lens: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        n, hidden = len(target.model.layers), target.config.hidden_size
        if not 1 <= num_layers <= n:
            raise ValueError(f"num_layers must be in [1, {n}], got {num_layers}")
        if lens is not None and (lens.shape != (hidden + 1, hidden) or lens.dtype != torch.float32
                                 or num_layers == n):
            raise ValueError(f"a lens must be float32 [{hidden + 1}, {hidden}] with num_layers < {n}, got "
                             f"{lens.dtype} {list(lens.shape)} with num_layers={num_layers}")
        self.target, self.num_layers, self.lm_head = target, num_layers, lm_head
        self.register_buffer("lens", None if lens is None else lens.to(target.group.device), persistent=False)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """int64 ``[T]`` ids and positions -> ``[T, hidden]`` normed hidden states (writes layers ``< L`` KV)."""
        m = self.target.model
        x = m.embed_tokens(input_ids)
        for layer in m.layers[: self.num_layers]:
            x = layer(positions, x, meta)
        if self.lens is not None:
            x = torch.addmm(self.lens[-1], x.float(), self.lens[:-1]).to(x.dtype)  # [x, 1] @ lens
        return m.norm(x)


def build_draft_head(target, model_dir: str, num_layers: int, draft_vocab_size: int,
                     always_token_ids: Iterable[int] = (), lens: bool = False, tokenizer=None) -> DraftHead:
    """This rank's draft head over ``target`` (its shard), LM-head rows read from ``model_dir``.

    With ``lens`` it is a collective (every rank calls it with the same arguments).

    Parameters
    ----------
    target : LlamaForCausalLM
        This rank's target shard (``target.group``, ``target.config``).
    model_dir : str
        The checkpoint the target was loaded from (``*.safetensors``): the
        draft rows come from ``lm_head.weight``, or ``model.embed_tokens.weight``
        when the embeddings are tied.
    num_layers : int
        Target layers the drafter runs (``1 .. num_hidden_layers``).
    draft_vocab_size : int
        Target ids the draft head predicts (:func:`select_draft_vocab`).
    always_token_ids : iterable of int
        Ids always in the draft vocabulary (the stop tokens); the same on every rank.
    lens : bool
        Put a tuned-lens translator after layer ``L`` when ``L < num_hidden_layers``:
        loaded from the cache or fitted on the built-in calibration text
        (:func:`~tpguide.speculative.draft_lens.load_or_fit_lens`, which replaces
        the KV cache: build the Engine afterwards).
    tokenizer : transformers tokenizer, optional
        Driver only; needed with ``lens``.

    Raises
    ------
    ValueError
        Bad ``num_layers`` or ``draft_vocab_size``; the checkpoint lacks the
        LM-head tensor; the lens cannot be fitted (on every rank).
    """
    from pathlib import Path

    from safetensors import safe_open

    cfg = target.config
    translator = None
    if lens and 1 <= num_layers < cfg.num_hidden_layers:
        from tpguide.speculative.draft_lens import load_or_fit_lens

        translator = load_or_fit_lens(target, model_dir, num_layers, tokenizer)
    ids = select_draft_vocab(cfg.org_vocab_size, draft_vocab_size, always_token_ids)
    head = DraftLMHead(ids, cfg.hidden_size, cfg.org_vocab_size, target.group,
                       dtype=target.model.embed_tokens.weight.dtype)
    name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if name in f.keys():
                head.load_target_lm_head(f.get_slice(name))
                return DraftHead(target, num_layers, head, translator)
    raise ValueError(f"no tensor {name!r} in {model_dir!r}: cannot build the draft LM head")
