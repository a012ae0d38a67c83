"""Fused mixture-of-experts GEMMs (Triton): each program multiplies a block of the (token,
expert) pairs routed to one expert by a tile of that expert's weight.

The pairs are sorted by expert and each expert's group padded to a multiple of BLOCK_M
(`align_routes`), so every block of rows belongs to one expert and reads one weight matrix.
Two launches make the MLP: x @ w13[e].T for every pair (rows gathered from the token), then
silu(gate) * up (or the caller's activation), then @ w2[e].T scaled by the pair's routing
weight; a token's k rows are summed last. Each GEMM may add its expert's bias row (gpt-oss), and
the weights may have any strides (gpt-oss keeps the transposed checkpoint layout, so its w13 is
a transposed view). `fused_moe_ref` in kernels.reference is the plain-torch twin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._launch import check_device, dot_upcast
from kernels.activation import silu_and_mul

BLOCK_M = 16


@dataclass(frozen=True)
class AlignedRoutes:
    pair_of_row: torch.Tensor  # [R] int32: the (token, slot) pair index a row computes; pad: T*k
    expert_of_block: torch.Tensor  # [R // BLOCK_M] int32 (blocks past the last: any expert)
    used_blocks: torch.Tensor  # [1] int32: blocks holding rows; the rest exit at once


def align_routes(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> AlignedRoutes:
    """Without reading anything back to the host (so a CUDA graph can capture it): the row
    count is its upper bound, T * k plus each expert's padding at most."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    experts = flat.index_select(0, order)
    rank = torch.arange(pairs, device=ids.device) - start.index_select(0, experts)
    blocks = -(-(pairs + num_experts * (block_m - 1)) // block_m)
    pair_of_row = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=ids.device)
    pair_of_row[padded_start.index_select(0, experts) + rank] = order.to(torch.int32)
    first_rows = torch.arange(blocks, device=ids.device) * block_m
    expert_of_block = torch.searchsorted(padded_end, first_rows, right=True)
    return AlignedRoutes(
        pair_of_row,
        expert_of_block.clamp(max=num_experts - 1).to(torch.int32),
        (padded_end[-1:] // block_m).to(torch.int32),
    )


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    pair_of_row_ptr,
    expert_of_block_ptr,
    used_blocks_ptr,
    scale_ptr,
    bias_ptr,  # [E, N] (read only when BIAS)
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_om,
    A_ROWS_PER_TOKEN: tl.constexpr,  # top_k when A holds tokens, 1 when it holds pairs
    SCALE: tl.constexpr,
    BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32: the GPU's default tf32 drops mantissa bits
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    if block >= tl.load(used_blocks_ptr):
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_of_row_ptr + rows).to(tl.int64)
    valid = pairs < num_pairs
    a_rows = pairs // A_ROWS_PER_TOKEN
    expert = tl.load(expert_of_block_ptr + block).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0)[None, :]
    if SCALE:
        acc *= tl.load(scale_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(
        out_ptr + pairs[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & col_ok[None, :],
    )


def _moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    routes: AlignedRoutes,
    num_pairs: int,
    rows_per_token: int,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[p] = (a[p // rows_per_token] @ w[expert of p].T (+ bias[expert of p])) (* scale[p])
    for every pair p."""
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    blocks = routes.expert_of_block.numel()
    if blocks == 0:
        return out
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (blocks, triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        w,
        out,
        routes.pair_of_row,
        routes.expert_of_block,
        routes.used_blocks,
        scale if scale is not None else out,
        bias if bias is not None else out,
        num_pairs,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        A_ROWS_PER_TOKEN=rows_per_token,
        SCALE=scale is not None,
        BIAS=bias is not None,
        UPCAST=dot_upcast(_moe_gemm_kernel, a.dtype),
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    bias13: torch.Tensor | None = None,
    bias2: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I] (any strides), routing weights/ids [T, k] ->
    [T, H]; bias13 [E, 2I] and bias2 [E, H] added to each expert's projections where given;
    `activation` turns the [pairs, 2I] gate-up rows into [pairs, I]."""
    check_device(_moe_gemm_kernel, x, w13, w2)
    tokens, top_k = ids.shape
    x = x.contiguous()
    routes = align_routes(ids, w13.shape[0])
    pairs = tokens * top_k
    gate_up = _moe_gemm(x, w13, routes, pairs, top_k, None, bias13)
    hidden = activation(gate_up).contiguous()
    scale = weights.reshape(-1).float().contiguous()
    down = _moe_gemm(hidden, w2, routes, pairs, 1, scale, bias2)
    return down.view(tokens, top_k, w2.shape[1]).sum(dim=1, dtype=torch.float32).to(x.dtype)
