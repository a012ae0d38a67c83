"""The batched LoRA term on CUDA: shrink (x @ A of each row's adapter) and expand (@ B).

Rows are grouped by adapter slot into segments (`order[start:start+length]` are the row
indices of one slot), as punica's segmented gather matmul groups them. Slot s holds columns
[s * columns, (s + 1) * columns) of a [slots * columns, in] and of b_t [slots * columns, out],
so one segment reads one contiguous block of each; a rank below the slot width leaves zero
columns, which add nothing. Each program computes one tile of one segment: grid (tiles over
the longest segment's rows x tiles over the output columns, segments). Rows outside every
segment (the base model's) are never touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_device, dot_upcast, next_pow2

_BLOCK_M = 16  # tl.dot's MMA wants at least 16 rows; decode segments are shorter, padded
_BLOCK_K = 64
_MAX_BLOCK_N = 128


@triton.jit
def _segment_tile(
    order_ptr,
    seg_slot_ptr,
    seg_start_ptr,
    segment,
    seg_len,
    tiles_n,
    width,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """This program's tile of its segment: where the segment starts in `order`, its slot, the
    tile's positions in the segment and rows of x, its output columns (of `width`)."""
    start = tl.load(seg_start_ptr + segment).to(tl.int64)
    slot = tl.load(seg_slot_ptr + segment).to(tl.int64)
    offs_m = (tl.program_id(0) // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < seg_len
    rows = tl.load(order_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_n = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    return start, slot, offs_m, m_ok, rows, offs_n, offs_n < width


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    hidden_ptr,
    order_ptr,
    seg_slot_ptr,
    seg_start_ptr,
    seg_len_ptr,
    K,
    columns,
    stride_xm,
    stride_a,
    stride_h,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """hidden[start + m] = x[order[start + m]] @ a[slot block].T, in float32."""
    segment = tl.program_id(1)
    seg_len = tl.load(seg_len_ptr + segment)
    tiles_n = tl.cdiv(columns, BLOCK_N)
    if (tl.program_id(0) // tiles_n) * BLOCK_M >= seg_len:
        return
    start, slot, offs_m, m_ok, rows, offs_n, n_ok = _segment_tile(
        order_ptr, seg_slot_ptr, seg_start_ptr, segment, seg_len, tiles_n, columns, BLOCK_M, BLOCK_N
    )
    a_rows = slot * columns + offs_n
    dot_dtype = tl.float32 if DOT_UPCAST else x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        a = tl.load(
            a_ptr + a_rows[None, :] * stride_a + ks[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        acc = tl.dot(x.to(dot_dtype), a.to(dot_dtype), acc, input_precision=DOT_PRECISION)
    tl.store(
        hidden_ptr + (start + offs_m)[:, None] * stride_h + offs_n[None, :],
        acc,
        mask=m_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _lora_expand_kernel(
    hidden_ptr,
    b_t_ptr,
    out_ptr,
    order_ptr,
    seg_slot_ptr,
    seg_start_ptr,
    seg_len_ptr,
    N,
    columns,
    stride_h,
    stride_b,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[order[start + m]] += hidden[start + m] @ b_t[slot block] (each row in one segment
    only, so the read-modify-write needs no atomics)."""
    segment = tl.program_id(1)
    seg_len = tl.load(seg_len_ptr + segment)
    tiles_n = tl.cdiv(N, BLOCK_N)
    if (tl.program_id(0) // tiles_n) * BLOCK_M >= seg_len:
        return
    start, slot, offs_m, m_ok, rows, offs_n, n_ok = _segment_tile(
        order_ptr, seg_slot_ptr, seg_start_ptr, segment, seg_len, tiles_n, N, BLOCK_M, BLOCK_N
    )
    # The activations' precision for the product, as the CPU path computes it.
    dot_dtype = tl.float32 if DOT_UPCAST else b_t_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, columns, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < columns
        h = tl.load(
            hidden_ptr + (start + offs_m)[:, None] * stride_h + ks[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_t_ptr + (slot * columns + ks)[:, None] * stride_b + offs_n[None, :],
            mask=k_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        h = h.to(b_t_ptr.dtype.element_ty)  # rounded as the CPU path's hidden is
        acc = tl.dot(h.to(dot_dtype), b.to(dot_dtype), acc, input_precision=DOT_PRECISION)
    where = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    base = tl.load(where, mask=mask, other=0.0).to(tl.float32)
    tl.store(where, (base + acc).to(out_ptr.dtype.element_ty), mask=mask)


def lora_shrink_expand(
    x: torch.Tensor,
    a: torch.Tensor,
    b_t: torch.Tensor,
    out: torch.Tensor,
    order: torch.Tensor,
    seg_slots: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    max_seg_len: int,
    columns: int,
) -> torch.Tensor:
    """out (modified in place and returned) plus, for each segment i, the LoRA term of its
    rows order[seg_starts[i] : seg_starts[i] + seg_lens[i]] under slot seg_slots[i]:
    x [T, in], a [slots * columns, in], b_t [slots * columns, out], out [T, out];
    order int64, seg_* int32 on x's device; max_seg_len: the longest segment (host int)."""
    check_device(_lora_shrink_kernel, x, a, b_t, out, order, seg_slots, seg_starts, seg_lens)
    num_segments = seg_slots.shape[0]
    if num_segments == 0 or max_seg_len == 0 or x.shape[0] == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out.stride(-1) != 1 or a.stride(-1) != 1 or b_t.stride(-1) != 1:
        raise ValueError("lora_shrink_expand needs out, a and b_t with contiguous rows")
    in_features, out_features = a.shape[1], b_t.shape[1]
    hidden = torch.empty(order.shape[0], columns, dtype=torch.float32, device=x.device)
    tiles_m = triton.cdiv(max_seg_len, _BLOCK_M)
    upcast = dot_upcast(_lora_shrink_kernel, x.dtype)
    precision = "ieee" if x.dtype == torch.float32 else None
    block_n = min(_MAX_BLOCK_N, max(16, next_pow2(columns)))
    _lora_shrink_kernel[(tiles_m * triton.cdiv(columns, block_n), num_segments)](
        x,
        a,
        hidden,
        order,
        seg_slots,
        seg_starts,
        seg_lens,
        in_features,
        columns,
        x.stride(0),
        a.stride(0),
        hidden.stride(0),
        BLOCK_M=_BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=min(_BLOCK_K, max(16, next_pow2(in_features))),
        DOT_UPCAST=upcast,
        DOT_PRECISION=precision,
        num_warps=4,
    )
    block_n = min(_MAX_BLOCK_N, max(16, next_pow2(out_features)))
    _lora_expand_kernel[(tiles_m * triton.cdiv(out_features, block_n), num_segments)](
        hidden,
        b_t,
        out,
        order,
        seg_slots,
        seg_starts,
        seg_lens,
        out_features,
        columns,
        hidden.stride(0),
        b_t.stride(0),
        out.stride(0),
        BLOCK_M=_BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=min(_BLOCK_K, max(16, next_pow2(columns))),
        DOT_UPCAST=upcast,
        DOT_PRECISION=precision,
        num_warps=4,
    )
    return out
