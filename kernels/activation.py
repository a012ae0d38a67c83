"""Fused SiLU-and-multiply for the gated MLP: [gate; up] -> silu(gate) * up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_device, next_pow2

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    intermediate_size,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate_size + cols, mask=mask, other=0.0)
    # Round silu(gate) to the activation dtype before the product, like the unfused module.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols,
        (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*I] holding [gate; up] -> silu(gate) * up [..., I] in x.dtype."""
    intermediate_size = x.shape[-1] // 2
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    check_device(_silu_and_mul_kernel, x)
    out = torch.empty((*x.shape[:-1], intermediate_size), dtype=x.dtype, device=x.device)
    out2d = out.view(-1, intermediate_size)
    if x2d.shape[0] == 0 or intermediate_size == 0:
        return out
    block = min(_BLOCK, next_pow2(intermediate_size))
    grid = (x2d.shape[0], triton.cdiv(intermediate_size, block))
    _silu_and_mul_kernel[grid](
        x2d,
        out2d,
        intermediate_size,
        x2d.stride(0),
        out2d.stride(0),
        BLOCK=block,
        num_warps=4,
    )
    return out
