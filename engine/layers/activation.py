"""SiLU-and-mul over a fused [gate; up] projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] holding gate then up; returns silu(gate) * up, [..., d]."""
    if x.is_cuda:
        from kernels import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
