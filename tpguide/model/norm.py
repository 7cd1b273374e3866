"""RMS norms: Llama's ``w * x̂`` and Gemma's ``(1 + w) * x̂``, each cast exactly as transformers casts it."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from tpguide.kernels.fixed_order_cpu import mean_square_fixed_order
from tpguide.kernels.fused_cpu import fused_add_rms_norm, takes
from tpguide.kernels.triton_path import use_triton
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

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``x [..., hidden]`` -> ``RMSNorm(x)``; with ``residual`` (``x``'s shape and dtype) vLLM's
        ``fused_add_rms_norm``: ``(RMSNorm(x + residual), x + residual)``.

        Fixed-order on CPU (fp32 or bf16): one kernel,
        :func:`~tpguide.kernels.fused_cpu.fused_add_rms_norm`, with the bits of
        the add and the norm below (docs/architecture.md §6).  Fixed-order on
        the CUDA path: :func:`~tpguide.kernels.rms_norm_triton.rms_norm_triton`,
        one program per row (docs/gpu.md, "Exactness on CUDA").
        """
        if self.fixed_order and x.dtype == self.weight.dtype and use_triton(x):
            from tpguide.kernels.rms_norm_triton import rms_norm_triton

            out, h = rms_norm_triton(x, self.weight, self.eps, residual)
            return out if residual is None else (out, h)
        if self.fixed_order and takes(x) and x.dtype == self.weight.dtype:
            out, h = fused_add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, h)
        if residual is None:
            return self.weight * _normalize(x, self.eps, self.fixed_order).to(x.dtype)
        h = x + residual
        return self.weight * _normalize(h, self.eps, self.fixed_order).to(h.dtype), h


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
        """``[..., hidden] -> [..., hidden]``; fixed order on the CUDA path as :meth:`RMSNorm.forward`."""
        if self.fixed_order and x.dtype == self.weight.dtype and use_triton(x):
            from tpguide.kernels.rms_norm_triton import rms_norm_triton

            return rms_norm_triton(x, self.weight, self.eps, gemma=True)[0]
        return (_normalize(x, self.eps, self.fixed_order) * (1.0 + self.weight.float())).to(x.dtype)
