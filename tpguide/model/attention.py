"""Attention over a per-rank KV cache for a mixed batch.

A step's tokens are flattened: sequence ``s`` contributes its new tokens
``query_start_loc[s] : query_start_loc[s+1]`` (a whole prompt, a prefill
chunk continuing a cached prefix, or one decode token); their positions are
``context_lens[s] .. context_lens[s] + query_len - 1``.  The KV cache is a
pool of fixed-size blocks (paged, docs/architecture.md §7 "KV cache")::

    k_cache / v_cache : [num_blocks, block_size, num_kv_heads, head_dim]

and each sequence has a block table: position ``j`` of sequence ``s`` lives in
block ``block_tables[s, j // block_size]``, row ``j % block_size``.  A dense
per-slot cache is the special case of one block of ``max_model_len``
positions per sequence (:meth:`AttentionMetadata.from_lists`).

:class:`Attention` writes the new keys and values at their ``(block, row)``;
then on the plain path it pads queries to ``[num_seqs, max_query_len]``,
gathers keys ``[num_seqs, max_seq_len]`` through the block tables (one
``index_select`` on the flattened pool) and runs one
``F.scaled_dot_product_attention`` with a causal mask (query ``i`` of
sequence ``s`` sees cache positions ``<= context_lens[s] + i``).

Sliding-window layers (Mistral, Qwen2/3 with ``use_sliding_window``, Phi-3,
Gemma 2/3's local layers) add a window to that mask: query position ``p``
sees keys ``p - sliding_window < j <= p`` (transformers'
``sliding_window_overlay``); the cache keeps every position, the mask hides
the old ones.  Attention-logit soft-capping (Gemma 2) needs the scores, so
those layers run the plain ``softmax(cap * tanh(q k^T * scale / cap) + mask) v``
instead of SDPA.

With ``fixed_order`` (set by a TP-invariant model) attention on CPU runs the
fixed-order C kernel instead
(:func:`tpguide.kernels.fixed_order_cpu.attention_fixed_order`): each query
token reads only its own sequence's cached keys, in key order, so its output
does not depend on the other sequences of the batch, on the padding to
``max_seq_len``, on how the prompt was chunked, or on the thread count.
There :meth:`Attention.forward_rotary` also applies RoPE to q and k and
writes k and v into the cache in one kernel
(:func:`tpguide.kernels.fused_cpu.rotary_fixed_order`), and the attention
kernel stores its output in the model dtype (docs/architecture.md §6).

With ``fixed_order`` on the CUDA code path
(:func:`tpguide.kernels.triton_path.use_triton`) :meth:`Attention.forward_rotary`
rotates q and k and writes k and v into the pool in one launch
(:func:`~tpguide.kernels.rotary_triton.rotary_and_cache_write_triton`;
:meth:`Attention.forward`, given rotated k, writes with
:func:`~tpguide.kernels.kv_cache_write_triton.write_kv_cache_`); slot ``-1``,
a padding token, writes nothing.  Attention is the Triton
kernel :func:`~tpguide.kernels.paged_attention_triton.paged_attention_fixed_order`,
which reads the pool through the block tables: no padded gather, no mask,
no SDPA, and a token of position ``-1`` gives a zero row (docs/gpu.md,
"Exactness on CUDA").  That path needs only ``block_tables``,
``token_seq_index``, ``token_positions`` and :meth:`AttentionMetadata.slot_mapping`;
the SDPA mask and gather index are built on first use only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tpguide.kernels.fixed_order_cpu import attention_fixed_order
from tpguide.kernels.fused_cpu import rotary_fixed_order, takes
from tpguide.kernels.triton_path import use_triton


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each sequence of a flattened batch reads and writes the KV cache.

    Attributes
    ----------
    block_tables : torch.Tensor
        int64 ``[num_seqs, max_blocks]``: the KV-cache blocks of each
        sequence in position order (position ``j`` is in block
        ``block_tables[s, j // block_size]``); entries past a sequence's
        ``ceil(seq_len / block_size)`` blocks are padding (0) and never written.
    query_start_loc : torch.Tensor
        int64 ``[num_seqs + 1]``: offsets of each sequence's new tokens in the
        flattened batch (tokens); ``query_start_loc[-1] == num_tokens``.
    context_lens : torch.Tensor
        int64 ``[num_seqs]``: tokens already cached before this step.
    query_lens, seq_lens : torch.Tensor
        int64 ``[num_seqs]``: new tokens; ``context_lens + query_lens``.
    token_seq_index : torch.Tensor
        int64 ``[num_tokens]``: the sequence (0..num_seqs-1) of each token.
    token_query_index : torch.Tensor
        int64 ``[num_tokens]``: index of each token among its sequence's new tokens.
    token_positions : torch.Tensor
        int64 ``[num_tokens]``: absolute position of each new token,
        ``context_lens[s] + token_query_index`` (the ``positions`` the model takes).
        A padding token (CUDA path only) has position ``-1``, any valid sequence index.
    max_query_len, max_seq_len : int

    The SDPA mask (:attr:`attn_mask`, :meth:`sliding_window_mask`) and the
    block-size dependent indices (:meth:`slot_mapping`, :meth:`key_index`)
    are derived on first use and cached, so all layers of one step share
    one, and a step on the CUDA path never builds a mask.
    """

    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    seq_lens: torch.Tensor
    token_seq_index: torch.Tensor
    token_query_index: torch.Tensor
    token_positions: torch.Tensor
    max_query_len: int
    max_seq_len: int
    _derived: Dict[object, torch.Tensor] = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def attn_mask(self) -> torch.Tensor:
        """bool ``[num_seqs, 1, max_query_len, max_seq_len]``: query ``i`` of sequence ``s`` sees keys ``<= context_lens[s] + i``.

        Built on first use, shared by every layer.  Padded query rows keep
        key 0 visible so no row is all-masked; they are dropped after attention.
        """
        mask = self._derived.get("causal")
        if mask is None:
            mask = self._derived["causal"] = self._causal_mask()
        return mask

    def sliding_window_mask(self, sliding_window: int) -> torch.Tensor:
        """bool ``[num_seqs, 1, max_query_len, max_seq_len]``: :attr:`attn_mask` and ``key > query_pos - window``.

        Padded query rows keep key 0 visible, as in :attr:`attn_mask`.
        """
        mask = self._derived.get(sliding_window)
        if mask is None:
            device = self.block_tables.device
            q_idx = torch.arange(self.max_query_len, device=device)  # [Q]
            query_pos = self.context_lens[:, None] + q_idx  # [S, Q]
            key_pos = torch.arange(self.max_seq_len, device=device)  # [K]
            in_window = key_pos[None, None, :] > query_pos[:, :, None] - sliding_window  # [S, Q, K]
            padded_row = (q_idx[None, :] >= self.query_lens[:, None])[:, :, None]  # [S, Q, 1]
            in_window = in_window | (padded_row & (key_pos == 0))
            mask = self.attn_mask & in_window.unsqueeze(1)
            self._derived[sliding_window] = mask
        return mask

    def slot_mapping(self, block_size: int) -> torch.Tensor:
        """int64 ``[num_tokens]``: the flat pool row ``block * block_size + offset`` each new token's k/v goes to.

        ``-1`` for a padding token (position ``< 0``): nothing is written.
        """
        slots = self._derived.get(("write", block_size))
        if slots is None:
            slots = self._derived[("write", block_size)] = self._slot_mapping(block_size)
        return slots

    def key_index(self, block_size: int) -> torch.Tensor:
        """int64 ``[num_seqs, max_seq_len]``: the flat pool row of every key position (padding reads block 0)."""
        index = self._derived.get(("read", block_size))
        if index is None:
            index = self._derived[("read", block_size)] = self._key_index(block_size)
        return index

    def _slot_mapping(self, block_size: int) -> torch.Tensor:
        pos = self.token_positions.clamp(min=0)
        slots = self.block_tables[self.token_seq_index, pos // block_size] * block_size + pos % block_size  # [T]
        return torch.where(self.token_positions < 0, -1, slots)

    def _causal_mask(self) -> torch.Tensor:
        device = self.block_tables.device
        key_pos = torch.arange(self.max_seq_len, device=device)  # [K]
        query_pos = self.context_lens[:, None] + torch.arange(self.max_query_len, device=device)  # [S, Q]
        return (key_pos[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)  # [S, 1, Q, K]

    def _key_index(self, block_size: int) -> torch.Tensor:
        j = torch.arange(self.max_seq_len, device=self.block_tables.device)  # [K]
        col = (j // block_size).clamp(max=self.block_tables.size(1) - 1)  # past a shorter table: masked keys
        return self.block_tables[:, col] * block_size + (j % block_size)  # [S, K]

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.size(0))

    @property
    def num_tokens(self) -> int:
        return int(self.token_seq_index.numel())

    @classmethod
    def from_lists(cls, seq_slots: Sequence[int], query_lens: Sequence[int], context_lens: Sequence[int],
                   device: Optional[torch.device] = None) -> "AttentionMetadata":
        """A dense per-slot cache: one block of ``max_model_len`` positions per sequence (its slot).

        Raises
        ------
        ValueError
            As :meth:`from_block_tables`, or a slot used twice.
        """
        if len(set(seq_slots)) != len(seq_slots):
            raise ValueError(f"seq_slots must be distinct, got {list(seq_slots)}")
        return cls.from_block_tables([[int(s)] for s in seq_slots], query_lens, context_lens, device)

    @classmethod
    def from_block_tables(cls, block_tables: Sequence[Sequence[int]], query_lens: Sequence[int],
                          context_lens: Sequence[int], device: Optional[torch.device] = None,
                          block_size: Optional[int] = None) -> "AttentionMetadata":
        """Build from per-sequence Python lists (one entry per sequence, batch order).

        Parameters
        ----------
        block_tables : list of list of int
            Each sequence's blocks in position order (ragged; padded with 0).
        query_lens, context_lens : list of int
        block_size : int, optional
            When given, every table must cover its ``context_len + query_len``
            positions (``len(table) * block_size >= seq_len``).

        Raises
        ------
        ValueError
            Lists of different lengths, an empty batch, ``query_len < 1``,
            ``context_len < 0``, an empty or negative block table, or a table
            too short for its sequence.
        """
        n = len(block_tables)
        if not n or len(query_lens) != n or len(context_lens) != n:
            raise ValueError(
                f"need equal, non-empty lists: block_tables={len(block_tables)}, "
                f"query_lens={len(query_lens)}, context_lens={len(context_lens)}"
            )
        if min(query_lens) < 1 or min(context_lens) < 0:
            raise ValueError(f"query_lens must be >= 1 and context_lens >= 0, got {list(query_lens)}, {list(context_lens)}")
        if min(len(t) for t in block_tables) < 1 or min(min(t) for t in block_tables) < 0:
            raise ValueError(f"every sequence needs a non-empty block table of block ids >= 0, got {list(block_tables)}")
        if block_size is not None:
            short = [i for i in range(n) if len(block_tables[i]) * block_size < context_lens[i] + query_lens[i]]
            if short:
                i = short[0]
                raise ValueError(f"sequence {i}: block table of {len(block_tables[i])} blocks x {block_size} tokens "
                                 f"cannot hold {context_lens[i] + query_lens[i]} positions")
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([[*t, *([0] * (width - len(t)))] for t in block_tables], dtype=torch.int64)
        ql, cl = [int(x) for x in query_lens], [int(x) for x in context_lens]
        start = [0]
        for x in ql:
            start.append(start[-1] + x)
        # per token, in Python lists: a decode step's few values cost less than a torch op each
        seq_index = [i for i, x in enumerate(ql) for _ in range(x)]  # [T]
        query_index = [j for x in ql for j in range(x)]  # [T]
        positions = [cl[i] + j for i, j in zip(seq_index, query_index)]  # [T]
        seq_lens = [c + x for c, x in zip(cl, ql)]

        def tensor(values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            block_tables=tables.to(device=device),
            query_start_loc=tensor(start),
            context_lens=tensor(cl),
            query_lens=tensor(ql),
            seq_lens=tensor(seq_lens),
            token_seq_index=tensor(seq_index),
            token_query_index=tensor(query_index),
            token_positions=tensor(positions),
            max_query_len=max(ql),  # host values: no device sync
            max_seq_len=max(seq_lens),
        )


class Attention(nn.Module):
    """Scaled dot-product attention of this rank's heads over its KV cache.

    Parameters
    ----------
    num_heads, num_kv_heads : int
        This rank's (padded) query and KV heads; ``num_heads % num_kv_heads == 0``.
    head_dim : int
    scale : float
        Softmax scale, ``head_dim ** -0.5`` for Llama.
    sliding_window : int, optional
        Tokens a query sees (itself included); None = full causal attention.
    logit_softcap : float, optional
        Scores become ``cap * tanh(scores / cap)`` before the mask (Gemma 2).

    Attributes
    ----------
    k_cache, v_cache : torch.Tensor or None
        The block pool ``[num_blocks, block_size, num_kv_heads, head_dim]``,
        set by the model's ``allocate_kv_cache``.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window, self.logit_softcap = sliding_window, logit_softcap
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None

    #: Set by a TP-invariant model: on CPU, the fixed-order kernel (module docstring).
    fixed_order: bool = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attend the new tokens; writes their k/v into the cache (in place).

        Parameters
        ----------
        q : ``[T, num_heads, head_dim]``
        k, v : ``[T, num_kv_heads, head_dim]``
        meta : AttentionMetadata

        Returns
        -------
        torch.Tensor
            ``[T, num_heads * head_dim]``.
        """
        block_size = self._check_cache(meta)
        num_blocks = self.k_cache.size(0)
        seq, qi = meta.token_seq_index, meta.token_query_index  # [T], [T]
        flat_k = self.k_cache.view(num_blocks * block_size, self.num_kv_heads, self.head_dim)
        flat_v = self.v_cache.view(num_blocks * block_size, self.num_kv_heads, self.head_dim)
        rows = meta.slot_mapping(block_size)  # [T]
        if self.fixed_order and use_triton(q):  # the CUDA path (module docstring)
            from tpguide.kernels.kv_cache_write_triton import write_kv_cache_

            write_kv_cache_(k, v, self.k_cache, self.v_cache, rows)
            return self._attend_paged_triton(q, meta)
        flat_k[rows] = k
        flat_v[rows] = v
        if self.fixed_order:
            return self._attend_fixed_order(q, meta)

        num_seqs, max_q, max_s = meta.num_seqs, meta.max_query_len, meta.max_seq_len
        if max_q == 1:  # decode only: one token per sequence, already in sequence order
            q_pad = q.unsqueeze(1)  # [S, 1, H, D]
        else:
            q_pad = q.new_zeros(num_seqs, max_q, self.num_heads, self.head_dim)  # [S, Q, H, D]
            q_pad[seq, qi] = q
        index = meta.key_index(block_size)  # [S, K] flat pool rows
        keys = flat_k.index_select(0, index.flatten()).view(num_seqs, max_s, self.num_kv_heads, self.head_dim)
        values = flat_v.index_select(0, index.flatten()).view(num_seqs, max_s, self.num_kv_heads, self.head_dim)
        mask = meta.attn_mask if self.sliding_window is None else meta.sliding_window_mask(self.sliding_window)
        if self.logit_softcap is None:
            out = F.scaled_dot_product_attention(
                q_pad.transpose(1, 2),  # [S, H, Q, D]
                keys.transpose(1, 2),  # [S, Hkv, K, D]
                values.transpose(1, 2),
                attn_mask=mask,  # [S, 1, Q, K]
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )  # [S, H, Q, D]
        else:
            out = self._softcapped(q_pad.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), mask)
        if max_q == 1:  # decode: row s is token s
            return out.reshape(num_seqs, self.num_heads * self.head_dim)
        out = out.transpose(1, 2)[seq, qi]  # [T, H, D]
        return out.flatten(1)

    def fuses_rotary(self, q: torch.Tensor) -> bool:
        """Whether :meth:`forward_rotary` takes ``q``: fixed order, on the CUDA path or on CPU in fp32 or bf16."""
        return self.fixed_order and (use_triton(q) or takes(q))

    def forward_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """RoPE of q and k, the k/v cache write and attention (fixed-order path, :meth:`fuses_rotary`).

        The bits of ``q, k = rotary(q, k)`` then :meth:`forward`, in two kernels:
        one rotates q and k and writes k, v at the tokens' cache rows (CPU:
        :func:`~tpguide.kernels.fused_cpu.rotary_fixed_order`; the CUDA path:
        :func:`~tpguide.kernels.rotary_triton.rotary_and_cache_write_triton`,
        padding rows' slot ``-1`` written nowhere), then the attention kernel
        storing ``q``'s dtype.

        Parameters
        ----------
        q : ``[T, num_heads, head_dim]``, not yet rotated (any strides, unit last stride).
        k, v : ``[T, num_kv_heads, head_dim]``, k not yet rotated.
        cos, sin : ``[T, 1, rotary_dim]`` in ``q``'s dtype (:meth:`~tpguide.model.rotary.RotaryEmbedding.cos_sin`).
        meta : AttentionMetadata

        Returns
        -------
        torch.Tensor
            ``[T, num_heads * head_dim]`` in ``q``'s dtype.

        Raises
        ------
        RuntimeError
            No KV cache allocated.
        ValueError
            As :meth:`forward`, or a cache row outside the pool.
        """
        block_size = self._check_cache(meta)
        if use_triton(q):
            from tpguide.kernels.rotary_triton import rotary_and_cache_write_triton

            q = rotary_and_cache_write_triton(q, k, v, cos, sin, self.k_cache, self.v_cache,
                                              meta.slot_mapping(block_size))
            return self._attend_paged_triton(q, meta)
        q, _ = rotary_fixed_order(q, k, cos, sin, v, self.k_cache, self.v_cache, meta.slot_mapping(block_size))
        return self._attend_fixed_order(q, meta)

    def _check_cache(self, meta: AttentionMetadata) -> int:
        """The pool's block size; raises as :meth:`forward` without a cache or with too short block tables."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("KV cache not allocated: call model.allocate_kv_cache(num_blocks, block_size)")
        block_size = self.k_cache.size(1)
        if meta.max_seq_len > meta.block_tables.size(1) * block_size:
            raise ValueError(f"sequence length {meta.max_seq_len} exceeds its block tables' "
                             f"{meta.block_tables.size(1)} blocks x {block_size} tokens")
        return block_size

    def _attend_paged_triton(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The CUDA path's fixed-order paged attention over the written cache: ``[T, H, D] -> [T, H * D]``."""
        from tpguide.kernels.paged_attention_triton import paged_attention_fixed_order

        return paged_attention_fixed_order(q, self.k_cache, self.v_cache, meta.block_tables, meta.token_seq_index,
                                           meta.token_positions, self.scale, self.sliding_window,
                                           self.logit_softcap).flatten(1)

    def _attend_fixed_order(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The fixed-order kernel over the written cache: ``[T, H, D] -> [T, H * D]`` stored in ``q``'s dtype."""
        out = attention_fixed_order(q, self.k_cache, self.v_cache, meta.block_tables, meta.token_seq_index,
                                    meta.token_positions, self.scale, self.sliding_window, self.logit_softcap,
                                    out_dtype=q.dtype, max_seq_len=meta.max_seq_len)
        return out.flatten(1)

    def _softcapped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``q [S, H, Q, D]``, ``k/v [S, Hkv, K, D]``, bool ``mask [S, 1, Q, K]`` -> ``[S, H, Q, D]``.

        As transformers' ``eager_attention_forward`` with ``softcap``: scores
        capped, then masked, softmax in fp32.
        """
        group = self.num_heads // self.num_kv_heads
        if group > 1:  # KV head j serves query heads j*group .. (j+1)*group-1
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale  # [S, H, Q, K]
        scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)
