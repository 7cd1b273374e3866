"""The router of a mixture-of-experts layer: replicated gate, fp32 softmax, top-k with a fixed tie rule.

Qwen3-MoE and Mixtral route alike (transformers' ``Qwen3MoeTopKRouter``,
``MixtralTopKRouter``)::

    router_logits = x @ gate^T                   # [T, E], the model dtype
    probs = softmax(router_logits, fp32)         # per row
    top-k of probs                               # ties: lowest expert id first (below)
    weights /= weights.sum()  if norm_topk_prob  # Mixtral: always

Every rank holds the whole gate and computes the same routing: a token's
experts and weights depend on its own hidden state only (the gate's matmul
runs the fixed-order kernels, the softmax reduces per row, the top-k is a
stable sort), never on the tp size or the other tokens of the step.

**Tie rule.** Among equal probabilities the expert with the lower id ranks
first (a stable descending sort over ids in ascending order), on every
rank and device.  ``torch.topk`` leaves ties unspecified; transformers uses
it, so a tie is the one case where the two may pick different experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpguide.model.invariant_reduce import invariant_linear, packed_weight, packs_on_cpu
from tpguide.model.weight_slice import default_weight_loader


def select_experts(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``top_k`` experts and their routing weights, in ascending expert id.

    Parameters
    ----------
    router_logits : torch.Tensor
        ``[T, E]`` any float dtype (the gate's output in the model dtype).
    top_k : int
        Experts per token, ``1 <= top_k <= E``.
    norm_topk_prob : bool
        Divide the ``top_k`` probabilities by their sum (added in rank order,
        the largest first).

    Returns
    -------
    (topk_ids, topk_weights)
        int64 ``[T, top_k]``, each row ascending; fp32 ``[T, top_k]``, the
        softmax probability (renormalised or not) of the expert beside it.

    Raises
    ------
    ValueError
        If ``top_k`` is outside ``[1, E]``.
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E] fp32, per row
    ranked = torch.sort(probs, dim=-1, descending=True, stable=True)  # equal probs: lower id first
    ids, weights = ranked.indices[:, :top_k], ranked.values[:, :top_k]  # [T, k], largest first
    if norm_topk_prob:
        total = weights[:, :1]
        for j in range(1, top_k):  # a fixed order of additions (largest first, as transformers' sum)
            total = total + weights[:, j:j + 1]
        weights = weights / total
    ids, perm = torch.sort(ids, dim=-1)  # ascending expert id: the order the outputs are added in
    return ids, torch.gather(weights, 1, perm)


class MoERouter(nn.Module):
    """The replicated gate ``[num_experts, hidden]`` and :func:`select_experts`.

    Parameters
    ----------
    hidden_size, num_experts, top_k : int
    norm_topk_prob : bool
    dtype : torch.dtype

    Attributes
    ----------
    weight : ``[num_experts, hidden_size]``, whole on every rank (checkpoint ``mlp.gate.weight``).
    """

    #: Set by a TP-invariant model: the gate's matmul through
    #: :func:`~tpguide.model.invariant_reduce.invariant_linear` (row-independent bits).
    fixed_order: bool = False

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def prepack(self) -> None:
        """Pack the gate for the fixed-order CPU kernel now (start-up)."""
        if self.fixed_order and packs_on_cpu(self.weight):
            packed_weight(self, self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` -> ``(topk_ids int64 [T, k], topk_weights fp32 [T, k])``, see :func:`select_experts`."""
        logits = invariant_linear(x, self.weight, self, x.dtype) if self.fixed_order else F.linear(x, self.weight)
        return select_experts(logits, self.top_k, self.norm_topk_prob)
