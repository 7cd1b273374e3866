"""RMS norms: Llama's ``w * x̂`` and Gemma's ``(1 + w) * x̂``, each cast exactly as transformers casts it."""

from __future__ import annotations

import torch
from torch import nn

from tpguide.model.weight_slice import default_weight_loader


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 ``x / sqrt(mean(x^2) + eps)`` over the last dim."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm as transformers' ``LlamaRMSNorm``: fp32 statistics, ``w * x̂.to(dtype)``.

    ``[..., hidden] -> [..., hidden]`` (also per head: ``[T, H, head_dim]`` for Qwen3's q/k norms).
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * _normalize(x, self.eps).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMS norm (``Gemma2RMSNorm``/``Gemma3RMSNorm``): ``(x̂ * (1 + w)).to(dtype)``, all in fp32.

    The checkpoint stores ``w`` (zero = identity).
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)
