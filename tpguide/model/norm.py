"""RMS norms: Llama's ``w * x̂`` and Gemma's ``(1 + w) * x̂``, each cast exactly as transformers casts it."""

from __future__ import annotations

import torch
from torch import nn

from tpguide.kernels.fixed_order_cpu import mean_square_fixed_order
from tpguide.model.weight_slice import default_weight_loader


def _normalize(x: torch.Tensor, eps: float, fixed_order: bool = False) -> torch.Tensor:
    """fp32 ``x / sqrt(mean(x^2) + eps)`` over the last dim.

    ``fixed_order`` (CPU): the mean of squares by the fixed-order kernel
    (:func:`tpguide.kernels.fixed_order_cpu.mean_square_fixed_order`), so a
    row's statistics do not depend on the other rows or the threads.
    """
    h = x.float()
    if fixed_order and not h.is_cuda:
        mean_square = mean_square_fixed_order(h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], 1)
    else:
        mean_square = h.pow(2).mean(-1, keepdim=True)
    return h * torch.rsqrt(mean_square + eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm as transformers' ``LlamaRMSNorm``: fp32 statistics, ``w * x̂.to(dtype)``.

    ``[..., hidden] -> [..., hidden]`` (also per head: ``[T, H, head_dim]`` for Qwen3's q/k norms).
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    #: Set by a TP-invariant model (see :func:`_normalize`).
    fixed_order: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * _normalize(x, self.eps, self.fixed_order).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMS norm (``Gemma2RMSNorm``/``Gemma3RMSNorm``): ``(x̂ * (1 + w)).to(dtype)``, all in fp32.

    The checkpoint stores ``w`` (zero = identity).
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    #: Set by a TP-invariant model (see :func:`_normalize`).
    fixed_order: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_normalize(x, self.eps, self.fixed_order) * (1.0 + self.weight.float())).to(x.dtype)
