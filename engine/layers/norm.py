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
