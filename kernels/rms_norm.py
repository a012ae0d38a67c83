"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_device, next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    hidden_size,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the activation dtype first, exactly as an unfused `x + residual`.
        summed = (x + r).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, 0) / hidden_size
    normed = (x * tl.math.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A [rows, hidden] view (or copy) with the hidden dim contiguous, as the kernel needs."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """out = weight * normalize(x) over the last dim (statistics in fp32, output in x.dtype).

    With `residual`, first residual = x + residual, normalize that, and return
    (out, new_residual); the inputs are not modified.
    """
    hidden_size = x.shape[-1]
    x2d = _rows(x)
    check_device(_rms_norm_kernel, x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2d = out.view(-1, hidden_size)
    if residual is not None:
        r2d = _rows(residual)
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ro2d = residual_out.view(-1, hidden_size)
    else:
        r2d = ro2d = x2d  # unused: HAS_RESIDUAL is False
    if x2d.shape[0] == 0:
        return out if residual is None else (out, residual_out)

    block = next_pow2(hidden_size)
    num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    _rms_norm_kernel[(x2d.shape[0],)](
        x2d,
        r2d,
        weight,
        out2d,
        ro2d,
        hidden_size,
        eps,
        x2d.stride(0),
        r2d.stride(0),
        out2d.stride(0),
        ro2d.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out if residual is None else (out, residual_out)
