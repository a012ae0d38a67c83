"""RMSNorm with an optional fused residual add (Triton kernel on CUDA, the CPU glue elsewhere)."""

from __future__ import annotations

import torch
from torch import nn

from engine.platforms.cpu import glue as cpu_glue


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize x; with a residual, normalize x + residual and also return that sum."""
        if x.is_cuda:
            from kernels import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        glue = cpu_glue.current()
        if residual is None:
            return glue.rms_norm(x, self.weight, self.eps)
        return glue.add_rms_norm(x, residual, self.weight, self.eps)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by (1 + weight) and computes in float32 before casting back, as
    the reference does (so its rounding matches in half precision too)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize x; with a residual, normalize x + residual and also return that sum."""
        if residual is not None:
            summed = x + residual
            return self._norm(summed), summed
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
