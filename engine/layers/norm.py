"""RMSNorm with an optional fused residual add (Triton kernel on CUDA, plain torch elsewhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.reference import rms_norm_ref


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
        if x.dtype != torch.float32:
            # HF's order of operations: normalize in fp32, cast, then scale
            return rms_norm_ref(x, self.weight, self.eps, residual)
        # one fused op; in fp32 it is HF's arithmetic exactly
        if residual is not None:
            residual = x + residual
            return self._normalize(residual), residual
        return self._normalize(x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
