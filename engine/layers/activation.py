"""SiLU-and-mul over a fused [gate; up] projection output."""

from __future__ import annotations

import torch

from engine.platforms.cpu import glue as cpu_glue


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] holding gate then up; returns silu(gate) * up, [..., d]."""
    if x.is_cuda:
        from kernels import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(x)
    return cpu_glue.current().silu_and_mul(x)
