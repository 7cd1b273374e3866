"""The mixture-of-experts block (Qwen3-MoE, Mixtral), sharded over TP and exact.

docs/models.md, "Mixtures of experts".  Per MoE layer, on every rank::

    x [T, H] ─ router (replicated, moe_router.py) ─ topk_ids, topk_weights [T, k] (ascending expert id)
      │
      └─ per expert e, on the rows routed to it (grouped: its weights read once per step):
           gate_up_proj (column-parallel, this rank's I/T columns) ─ act(gate) * up
           ─ down_proj partials per reduction unit (this rank's units)      fp32 [U_local, n_e, H]
      ─ per unit u: q_u[t] = sum_j w[t, j] * p_u[t, j]   in ascending expert id, fp32   [U_local, T, H]
      ─ all-gather the units, add them in unit order, round once               out [T, H] model dtype

**Sharding.**  Every rank holds a slice of every expert, like the dense MLP
(:class:`~tpguide.model.llama.LlamaMLP`: gate/up column-parallel, down
row-parallel); a rank holds ``1/tp`` of the expert weights.  Expert
parallelism (whole experts per rank) is not implemented.

**Exactness** (docs/architecture.md §6).  The down projection's partial sums
run over the fixed reduction units of the dense ``down_proj``
(:func:`~tpguide.model.invariant_reduce.reduction_block_size` of the expert
width); inside each unit the ``k`` weighted partials are added in ascending
expert id (plain fp32 multiplies and adds), then the units are gathered and
added in unit order, the same at every tp size: one all-gather per layer of
the dense MLP's size, not ``k`` times it.  Every matmul is a fixed-order
kernel whose rows are independent, so a (token, expert) pair's bits do not
depend on how many other tokens chose the expert.  So a token's output
depends on its own hidden state only: the same at tp 1-4, alone or batched,
chunked or not, verified as a draft or decoded.

**Weighting** as the family: Qwen3-MoE rounds the routing weights to the
model dtype (``router_weights_fp32`` False), Mixtral keeps them fp32.
transformers rounds each expert's output to the model dtype, weights it,
rounds again and accumulates in the model dtype in ascending expert id;
tpguide keeps the whole sum in fp32 and rounds once (the same value up to
fp32 reassociation; within rounding in bf16).

**Dispatch** (who computes which rows):

* ``"grouped"`` (CPU, and CUDA outside graph capture): the ``T*k`` pairs
  sorted by expert (a stable ``argsort``), the per-expert counts read on the
  host, one fixed-order matmul per expert over its rows (CPU: the C kernels
  of :mod:`tpguide.kernels.fixed_order_cpu` on each expert's packed weights;
  CUDA: the fixed-tiling Triton matmuls), results scattered back by pair;
* ``"all_rows"`` (CUDA while a graph is being captured): no host read of the
  routing; each expert runs over every row of the step and ``torch.where``
  keeps the rows routed to it.  Each expert's weights are still read once
  per step, at ``E / k`` times the expert FLOPs: meant for decode graphs.
  Its bits are those of ``"grouped"`` (rows are independent), tested on CPU.

Without ``tp_invariant`` the down projections' partials are weighted and
summed locally and all-reduced once (plain kernels, exact only up to rounding).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from tpguide.dist import TPGroup
from tpguide.dist import group as collectives
from tpguide.model.config import ModelConfig
from tpguide.model.invariant_reduce import sum_units, unit_partials
from tpguide.model.llama import LlamaMLP
from tpguide.model.moe_router import MoERouter

#: Values of :attr:`SparseMoeBlock.dispatch`.
DISPATCH_MODES = ("auto", "grouped", "all_rows")


class SparseMoeBlock(nn.Module):
    """One rank's shard of a mixture-of-experts feed-forward block.

    Parameters
    ----------
    config : ModelConfig
        ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
        ``norm_topk_prob``, ``router_weights_fp32``, ``tp_invariant``.
    group : TPGroup
    dtype : torch.dtype

    Attributes
    ----------
    gate : MoERouter
        Replicated (checkpoint ``mlp.gate.weight``, Mixtral ``block_sparse_moe.gate.weight``).
    experts : nn.ModuleList of LlamaMLP
        Expert ``e``'s ``gate_up_proj`` (``[2 * I/T, H]``) and ``down_proj``
        (``[H, I/T]``), this rank's slices.
    dispatch : str
        One of :data:`DISPATCH_MODES`; ``"auto"``: ``"all_rows"`` while a
        CUDA graph is being captured, else ``"grouped"`` (module docstring).
    """

    def __init__(self, config: ModelConfig, group: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.group = group
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.router_weights_fp32 = config.router_weights_fp32
        self.gate = MoERouter(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.norm_topk_prob, dtype)
        self.experts = nn.ModuleList(LlamaMLP(config, group, dtype, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        self.dispatch = "auto"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden] -> [T, hidden]`` (replicated, the model dtype)."""
        ids, weights = self.gate(x)  # [T, k] ascending expert id; fp32
        if not self.router_weights_fp32:
            weights = weights.to(x.dtype)  # Qwen3-MoE weights in the model dtype
        if self.experts[0].down_proj.reduction_unit is None:
            return self._forward_all_reduce(x, ids, weights)
        down = self.experts[0].down_proj
        partials = self._pair_partials(x, ids, down.num_local_units)  # fp32 [U_local, T*k, H]
        weighted = combine_experts(partials.view(down.num_local_units, x.shape[0], self.top_k, x.shape[1]), weights)
        return sum_units(weighted, down.num_real_units, self.group, x.dtype)  # [T, H], the one communication point

    def _mode(self, x: torch.Tensor) -> str:
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {self.dispatch!r}")
        if self.dispatch != "auto":
            return self.dispatch
        return "all_rows" if x.is_cuda and torch.cuda.is_current_stream_capturing() else "grouped"

    def _expert_partials(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on ``rows [n, H]``: fp32 ``[U_local, n, H]``, its down projection per reduction unit."""
        expert = self.experts[e]
        return self._down_partials(e, expert.act_and_mul(expert.gate_up_proj(rows)))

    def _down_partials(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """``h [n, I/T]`` (activated) -> fp32 ``[U_local, n, H]``: expert ``e``'s down projection per unit."""
        down = self.experts[e].down_proj
        return unit_partials(h, down.weight, down.num_local_units, down)

    def _pair_partials(self, x: torch.Tensor, ids: torch.Tensor, num_local_units: int) -> torch.Tensor:
        """fp32 ``[U_local, T*k, H]``: pair ``t*k + j`` holds expert ``ids[t, j]``'s partials for token ``t``."""
        num_tokens, k = ids.shape
        if num_tokens == 0:
            return x.new_zeros((num_local_units, 0, x.shape[1]), dtype=torch.float32)
        if self._mode(x) == "all_rows":
            out = x.new_zeros((num_local_units, num_tokens, k, x.shape[1]), dtype=torch.float32)
            for e in range(self.num_experts):
                hit = (ids == e)[None, :, :, None]  # [1, T, k, 1]
                out = torch.where(hit, self._expert_partials(e, x)[:, :, None, :], out)
            return out.view(num_local_units, num_tokens * k, x.shape[1])
        flat = ids.reshape(-1)  # [T*k]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens ascending inside
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the host read
        starts = [0, *itertools.accumulate(counts)]
        spans = [(e, starts[e], n) for e, n in enumerate(counts) if n]  # (expert, first pair, pairs)
        rows = x.index_select(0, order // k)  # [T*k, H], grouped by expert
        gate_up = torch.cat([self.experts[e].gate_up_proj(rows[a:a + n]) for e, a, n in spans])  # [T*k, 2I/T]
        h = self.experts[0].act_and_mul(gate_up)  # [T*k, I/T], elementwise: one call for every expert
        grouped = torch.cat([self._down_partials(e, h[a:a + n]) for e, a, n in spans], dim=1)  # [U_local, T*k, H]
        return torch.empty_like(grouped).index_copy_(1, order, grouped)  # back to pair order t*k + j

    def _forward_all_reduce(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Not TP-invariant: each expert's local down partial weighted, summed, one all-reduce."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            token, slot = torch.nonzero(ids == e, as_tuple=True)
            expert = self.experts[e]
            y = F.linear(expert.act_and_mul(expert.gate_up_proj(x[token])), expert.down_proj.weight)
            out.index_add_(0, token, y.float() * weights[token, slot, None].float())
        return collectives.all_reduce(out, self.group).to(x.dtype)


def combine_experts(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., T, H]``: ``sum_j weights[:, j] * y[..., :, j]``, ``j`` ascending, one multiply and one add per term.

    ``y [..., T, k, H]`` (any float dtype, the experts in ascending id; the
    leading dims are reduction units), ``weights [T, k]``; every product and
    sum in fp32, each exactly rounded (no fused multiply-add, whose use would
    differ between vector and scalar loops).
    """
    acc = y[..., 0, :].float() * weights[:, :1].float()
    for j in range(1, y.shape[-2]):
        acc = acc + y[..., j, :].float() * weights[:, j:j + 1].float()
    return acc


def moe_or_dense_mlp(layer: nn.Module, config: ModelConfig, group: TPGroup, dtype: torch.dtype,
                     layer_idx: int) -> nn.Module:
    """A decoder layer's ``make_mlp`` for a family with expert layers: the MoE block where ``config.moe_layers`` says."""
    if config.is_moe_layer(layer_idx):
        return SparseMoeBlock(config, group, dtype)
    return LlamaMLP(config, group, dtype)


def expert_weight_bytes(model: nn.Module) -> int:
    """Bytes of the expert weights (``gate_up_proj`` and ``down_proj`` of every expert) this rank's model holds."""
    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, SparseMoeBlock)
               for p in m.experts.parameters())
