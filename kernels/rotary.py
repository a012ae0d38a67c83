"""Neox-style rotary embedding applied in place to the query and key heads of each token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_device, next_pow2


@triton.jit
def _rotate_heads(
    base_ptr,
    num_heads,
    cos,
    sin,
    half_offsets,
    half_mask,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads < num_heads)[:, None] & half_mask[None, :]
    first = base_ptr + heads[:, None] * HEAD_DIM + half_offsets[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out_ty = base_ptr.dtype.element_ty
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    num_q_heads,
    num_kv_heads,
    stride_q,
    stride_k,
    stride_cache,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    half_offsets = tl.arange(0, HALF_PAD)
    half_mask = half_offsets < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cache + half_offsets, mask=half_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cache + HALF + half_offsets, mask=half_mask, other=0.0)
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_q, num_q_heads, cos, sin, half_offsets, half_mask,
        HEAD_DIM, HALF, Q_HEADS_PAD,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + token * stride_k, num_kv_heads, cos, sin, half_offsets, half_mask,
        HEAD_DIM, HALF, K_HEADS_PAD,
    )  # fmt: skip


def _heads_view(x: torch.Tensor, head_dim: int, name: str) -> tuple[int, int]:
    """(num_heads, token stride) of a [T, H*D] or [T, H, D] tensor whose heads are packed."""
    if x.dim() == 3 and x.shape[-1] == head_dim and x.stride(1) == head_dim:
        num_heads = x.shape[1]
    elif x.dim() == 2 and x.shape[-1] % head_dim == 0:
        num_heads = x.shape[-1] // head_dim
    else:
        raise ValueError(f"rotary_embedding needs {name} as [T, H*D] with packed heads")
    if x.stride(-1) != 1:
        raise ValueError(f"rotary_embedding needs {name} contiguous in its last dim")
    return num_heads, x.stride(0)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> None:
    """Rotate q [T, Hq*D] and k [T, Hkv*D] in place (neox halves), token t at positions[t].

    cos_sin_cache [max_pos, R] holds cos in its first R/2 columns and sin in the last R/2;
    the first R (<= head_dim) dims of every head rotate, the rest pass through. q and k may be
    row-strided views (e.g. slices of a fused QKV output).
    """
    num_q_heads, stride_q = _heads_view(q, head_dim, "q")
    num_kv_heads, stride_k = _heads_view(k, head_dim, "k")
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim > head_dim or rotary_dim % 2 or cos_sin_cache.stride(-1) != 1:
        raise ValueError(f"cos_sin_cache width {rotary_dim} does not fit head_dim {head_dim}")
    check_device(_rotary_kernel, positions, q, k, cos_sin_cache)
    num_tokens = positions.numel()
    if num_tokens == 0:
        return
    half = rotary_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        num_q_heads,
        num_kv_heads,
        stride_q,
        stride_k,
        cos_sin_cache.stride(0),
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_PAD=next_pow2(half),
        Q_HEADS_PAD=next_pow2(num_q_heads),
        K_HEADS_PAD=next_pow2(num_kv_heads),
        num_warps=4,
    )
