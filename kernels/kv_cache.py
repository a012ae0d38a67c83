"""Write the step's keys and values into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_device, next_pow2

# Elements (tokens x heads x dims) one program copies: enough work per program even for
# small KV widths (e.g. 3 heads x 64), few programs for the interpreter.
_TILE_ELEMENTS = 4096


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_valid = tokens < num_tokens
    slots = tl.load(slot_mapping_ptr + tokens, mask=token_valid, other=-1).to(tl.int64)
    blocks = slots // BLOCK_SIZE
    offsets = slots % BLOCK_SIZE

    # One row per token over its flattened (head, dim) elements.
    elements = tl.arange(0, WIDTH_PAD)
    heads = elements // HEAD_DIM
    dims = elements % HEAD_DIM
    mask = ((slots >= 0) & token_valid)[:, None] & (elements < NUM_KV_HEADS * HEAD_DIM)[None, :]

    k_src = tokens[:, None] * stride_k_t + heads[None, :] * stride_k_h + dims[None, :]
    k_dst = (
        blocks[:, None] * stride_kc_b
        + offsets[:, None] * stride_kc_s
        + heads[None, :] * stride_kc_h
        + dims[None, :]
    )
    k = tl.load(k_ptr + k_src, mask=mask)
    tl.store(k_cache_ptr + k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)

    v_src = tokens[:, None] * stride_v_t + heads[None, :] * stride_v_h + dims[None, :]
    v_dst = (
        blocks[:, None] * stride_vc_b
        + offsets[:, None] * stride_vc_s
        + heads[None, :] * stride_vc_h
        + dims[None, :]
    )
    v = tl.load(v_ptr + v_src, mask=mask)
    tl.store(v_cache_ptr + v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [T, Hkv, D] -> k_cache / v_cache [num_blocks, block_size, Hkv, D] at slot_mapping [T].

    A slot is block * block_size + offset; slot -1 (padding tokens) is skipped.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("reshape_and_cache needs the head dimension contiguous")
    check_device(_reshape_and_cache_kernel, k, v, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    width_pad = next_pow2(num_kv_heads * head_dim)
    block_t = min(next_pow2(num_tokens), max(1, _TILE_ELEMENTS // width_pad))
    _reshape_and_cache_kernel[(triton.cdiv(num_tokens, block_t),)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_T=block_t,
        WIDTH_PAD=width_pad,
        num_warps=4,
    )
