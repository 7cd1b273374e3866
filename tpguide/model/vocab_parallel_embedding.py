"""Vocabulary-parallel embedding and LM head.

Rank ``r`` holds rows ``[vocab_start_index, vocab_end_index)`` of the padded
vocabulary (:class:`~tpguide.model.vocab_shard.VocabShard`).  Layout for
``org_vocab_size=49157``, ``tp_size=2``::

    padded vocab   0 ........................ 24640 ................. 49157 .. 49280
    rank 0 rows    [ checkpoint rows 0..24639 ]
    rank 1 rows                              [ checkpoint rows ...49156 | zero ]
    LM-head logit                                                     | -inf  |

* :class:`VocabParallelEmbedding`: ids outside the rank's range give zero
  rows; one ``all_reduce`` sums the shards (every id lives on one rank).
* :class:`ParallelLMHead`: ``compute_logits`` returns this rank's fp32
  logits shard only; ids ``>= org_vocab_size`` (and ids the tokenizer cannot
  produce) are ``-inf``.  No full ``[rows, vocab]`` tensor is ever gathered.

After vLLM's ``vocab_parallel_embedding.py``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tpguide.dist import TPGroup
from tpguide.dist import group as collectives
from tpguide.kernels.fixed_order_cpu import unary_fixed_order
from tpguide.model.held_weights import embedding_rows
from tpguide.model.invariant_reduce import invariant_linear, packed_weight, packs_on_cpu
from tpguide.model.vocab_shard import VocabShard
from tpguide.model.weight_slice import Loadable, check_shape, copy_clipped_


class VocabParallelEmbedding(nn.Module):
    """Token embedding sharded along the vocabulary.

    Parameters
    ----------
    org_vocab_size : int
        Checkpoint rows.
    embedding_dim : int
    group : TPGroup
    dtype : torch.dtype

    Attributes
    ----------
    vocab_shard : VocabShard
    weight : ``[num_embeddings_per_partition, embedding_dim]``; padded rows zero.
    """

    def __init__(self, org_vocab_size: int, embedding_dim: int, group: TPGroup,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.group = group
        self.embedding_dim = embedding_dim
        self.vocab_shard = VocabShard.create(org_vocab_size, group.tp_rank, group.tp_size)
        rows = self.vocab_shard.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.zeros(rows, embedding_dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Loadable, shard_id: Any = None) -> None:
        """Copy checkpoint rows ``[vocab_start_index, vocab_end_index)`` of ``[org_vocab_size, dim]``."""
        check_shape(loaded, (self.vocab_shard.org_vocab_size, self.embedding_dim))
        copy_clipped_(param.data, loaded, 0, self.vocab_shard.vocab_start_index)

    def local_embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial embedding: rows of ids outside ``[vocab_start_index, vocab_end_index)`` are 0.

        ``input_ids`` int64 ``[T]`` -> ``[T, embedding_dim]``; the sum over ranks is the full embedding.
        """
        if self.group.tp_size == 1:
            return embedding_rows(input_ids, self.weight)  # the packed copy's rows when the weight is held packed
        start, end = self.vocab_shard.vocab_start_index, self.vocab_shard.vocab_end_index
        outside = (input_ids < start) | (input_ids >= end)  # [T]
        local_ids = (input_ids - start).masked_fill(outside, 0)
        return embedding_rows(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # [T, dim]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` int64 ``[T]`` -> ``[T, embedding_dim]``, replicated on every rank."""
        return collectives.all_reduce(self.local_embedding(input_ids), self.group)  # the one communication point


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """Embedding times a constant ``embed_scale`` (Gemma: ``sqrt(hidden_size)``).

    As transformers' ``Gemma2TextScaledWordEmbedding``: the scale is cast to
    the weight dtype first.  Set ``embed_scale`` after construction.
    """

    embed_scale: float = 1.0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` int64 ``[T]`` -> ``[T, embedding_dim]``, replicated."""
        scale = torch.tensor(self.embed_scale, dtype=torch.float32).to(self.weight.dtype)
        return super().forward(input_ids) * scale


class ParallelLMHead(VocabParallelEmbedding):
    """LM head sharded along the vocabulary; returns logits shards.

    Parameters
    ----------
    org_vocab_size, embedding_dim, group, dtype
        As for :class:`VocabParallelEmbedding`.
    tokenizer_vocab_size : int, optional
        Ids ``>= tokenizer_vocab_size`` are masked to ``-inf`` as well.
    logit_softcap : float, optional
        Final-logit soft-cap (Gemma 2): ``cap * tanh(logits / cap)``,
        elementwise, so each rank caps its own shard (before the bitmask and
        the ``-inf`` of padded ids); sampling stays identical at every tp size.

    Attributes
    ----------
    valid_vocab_size : int
        ``min(org_vocab_size, tokenizer_vocab_size)``: ids at or above get ``-inf``.

    Tied embeddings: the model assigns the embedding's ``weight`` Parameter to
    this module (same tensor, same shard layout).
    """

    def __init__(self, org_vocab_size: int, embedding_dim: int, group: TPGroup,
                 dtype: torch.dtype = torch.float32, tokenizer_vocab_size: Optional[int] = None,
                 logit_softcap: Optional[float] = None) -> None:
        super().__init__(org_vocab_size, embedding_dim, group, dtype)
        self.logit_softcap = logit_softcap
        if tokenizer_vocab_size is not None and tokenizer_vocab_size < 1:
            raise ValueError(f"tokenizer_vocab_size must be >= 1, got {tokenizer_vocab_size}")
        self.valid_vocab_size = min(org_vocab_size, tokenizer_vocab_size or org_vocab_size)
        # Columns of this rank's shard that hold real, producible tokens.
        self.num_valid_per_partition = max(
            0, min(self.vocab_shard.num_embeddings_per_partition,
                   self.valid_vocab_size - self.vocab_shard.vocab_start_index)
        )

    #: Set by a TP-invariant model: fixed-order matmul (see ColumnParallelLinear).
    fixed_order: bool = False
    #: :func:`~tpguide.model.invariant_reduce.prepack_weights` packs this (the largest) weight into its own
    #: storage where the panels fit it (:func:`~tpguide.model.held_weights.pack_in_place`).
    packs_in_place: bool = True

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - guard
        raise RuntimeError("ParallelLMHead has no forward; call compute_logits")

    def prepack(self) -> None:
        """Pack the weight for the fixed-order CPU kernel now (start-up), not in the first request's forward."""
        if self.fixed_order and packs_on_cpu(self.weight):
            packed_weight(self, self.weight)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's logits shard.

        Parameters
        ----------
        hidden_states : torch.Tensor
            ``[num_rows, embedding_dim]``, model dtype, replicated.

        Returns
        -------
        torch.Tensor
            fp32 ``[num_rows, padded_vocab_size // tp_size]`` (column ``j`` is
            global token id ``vocab_start_index + j``); ids ``>= valid_vocab_size``
            are ``-inf``.  A new tensor.
        """
        if self.fixed_order:  # columns independent of the shard width, the other rows and the threads
            logits = invariant_linear(hidden_states, self.weight, self)  # fp32 [R, V/T]
        else:
            logits = F.linear(hidden_states, self.weight).float()  # [R, V/T]
        if self.logit_softcap is not None and self.fixed_order and not logits.is_cuda:
            logits = unary_fixed_order(logits, "softcap", self.logit_softcap)  # scalar tanhf per element
        elif self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        if self.num_valid_per_partition < logits.size(1):
            logits[:, self.num_valid_per_partition:] = float("-inf")
        return logits
