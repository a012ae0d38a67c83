"""Unified paged attention: one launch for a mixed batch of prefill chunks and decodes.

Each program owns BLOCK_Q query tokens of one sequence times all query heads that share one
KV head (GQA), stacked into BLOCK_M rows, so every K/V tile is loaded once per group. It walks
the sequence's block table tile by tile with an fp32 online softmax (exp2 domain). Long
contexts at small batch can instead be split along the context (flash decoding): each split
writes a partial output with its running max and sum, and a second small kernel merges them.
Under a sliding window a program starts at the first tile its earliest query sees, so blocks
wholly before every query's window are never read (they may be freed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_device, dot_upcast, next_pow2
from kernels.paged_attention_tiles import (
    PrefillTiles,
    _launch_shape,
    choose_num_splits,
    padded_head_dim,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _unified_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,  # [T, Hq, NUM_SPLITS, HEAD_DIM_PAD] fp32, only when NUM_SPLITS > 1
    part_max_ptr,  # [T, Hq, NUM_SPLITS] fp32 (log2 domain)
    part_sum_ptr,  # [T, Hq, NUM_SPLITS] fp32
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_seqs,
    num_q_heads,
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window in tokens (read only when WINDOWED)
    softcap,  # scores s become softcap * tanh(s / softcap) (read only when SOFTCAP)
    sinks_ptr,  # [Hq] fp32 sink logits (read only when SINKS)
    stride_q_t,
    stride_q_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE_ONLY:
        seq = q_block_id  # one query token per sequence: program i is sequence i
        q_block = 0
    else:
        # Sequence i owns q-block ids from query_start_loc[i] // BLOCK_Q + i on: the `+ i`
        # leaves room for the partial block each sequence may end with, so ids never collide.
        # Binary search for the last sequence starting at or before this id (inline: nested
        # jit calls are slow in the interpreter).
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block_id:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
        q_block = q_block_id - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return  # a spare id (the grid covers the worst case), or a sequence with no query
    seq_len = tl.load(seq_lens_ptr + seq)
    context_before = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows // QUERIES_PER_KV < BLOCK_Q) & (q_idx < q_len)
    q_pos = context_before + q_idx
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    token = (q_start + q_idx).to(tl.int64)
    q_offsets = token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :]
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(k_cache_ptr.dtype.element_ty)
    if DOT_UPCAST:
        # The interpreter's tl.dot multiplies bf16 bit patterns as integers: feed it fp32.
        q = q.to(tl.float32)

    # Keys up to the last query position of this block; later tiles are fully masked.
    last_q_idx = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_len = context_before + last_q_idx + 1
    num_tiles = (kv_len + TILE_N - 1) // TILE_N
    kv_lo = 0
    if WINDOWED:
        # The block's first query sees keys from its position - window + 1 on; earlier slots
        # (possibly of freed blocks) are never loaded.
        kv_lo = tl.maximum(context_before + q_block * BLOCK_Q - window + 1, 0)
    first_tile = kv_lo // TILE_N
    if NUM_SPLITS == 1:
        tile_lo = first_tile
        tile_hi = num_tiles
    else:
        tiles_per_split = (num_tiles - first_tile + NUM_SPLITS - 1) // NUM_SPLITS
        tile_lo = first_tile + split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_table = block_tables_ptr + seq * stride_bt
    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * TILE_N + tl.arange(0, TILE_N)
        kv_valid = (kv_pos < kv_len) & (kv_pos >= kv_lo)
        physical = tl.load(block_table + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
        in_block = kv_pos % BLOCK_SIZE

        k_offsets = (
            physical[None, :] * stride_k_b
            + in_block[None, :] * stride_k_s
            + kv_head * stride_k_h
            + dims[:, None]
        )
        k = tl.load(k_cache_ptr + k_offsets, mask=dim_valid[:, None] & kv_valid[None, :], other=0.0)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            # in the natural-log domain: c * tanh(s / c), tanh(x) = 1 - 2 / (e^(2x) + 1)
            capped = s / (softcap * 1.4426950408889634)
            s = softcap * 1.4426950408889634 * (1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0))
        causal = (kv_pos[None, :] <= q_pos[:, None]) & kv_valid[None, :]
        if WINDOWED:
            causal = causal & (kv_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(causal, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet (padding rows) keep m = -inf; avoid -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)

        v_offsets = (
            physical[:, None] * stride_v_b
            + in_block[:, None] * stride_v_s
            + kv_head * stride_v_h
            + dims[None, :]
        )
        v = tl.load(v_cache_ptr + v_offsets, mask=kv_valid[:, None] & dim_valid[None, :], other=0.0)
        p = p.to(v.dtype).to(q.dtype)  # P rounds to the cache dtype, as the GPU's PV dot sees it
        acc = acc * alpha[:, None] + tl.dot(p, v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    if SINKS and NUM_SPLITS == 1:  # split runs add the sink when they merge
        # The sink is one more score (log2 domain) in the denominator, with no value row.
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=float("-inf")) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = tl.exp2(m_i - m_fin)
        l_i = l_i * alpha + tl.exp2(sink - m_fin)
        acc = acc * alpha[:, None]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        o_offsets = token[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :]
        tl.store(out_ptr + o_offsets, acc.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Empty splits still write (m = -inf, l = 0) so the merge never reads garbage.
        part_row = (token * num_q_heads + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part_row, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part_row, l_i, mask=row_valid)
        part_offsets = part_row[:, None] * HEAD_DIM_PAD + dims[None, :]
        tl.store(part_out_ptr + part_offsets, acc, mask=q_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    sinks_ptr,  # [Hq] fp32 sink logits (read only when SINKS)
    num_q_heads,
    stride_o_t,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    part_row = (token * num_q_heads + head) * NUM_SPLITS + splits
    m = tl.load(part_max_ptr + part_row, mask=split_valid, other=float("-inf"))
    sums = tl.load(part_sum_ptr + part_row, mask=split_valid, other=0.0)
    m_max = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # log2 domain, as m
        m_max = tl.maximum(m_max, sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_max) * sums
    total = tl.sum(weight, 0)
    if SINKS:
        total += tl.exp2(sink - m_max)
    total = tl.where(total == 0.0, 1.0, total)

    part = tl.load(
        part_out_ptr + part_row[:, None] * HEAD_DIM_PAD + dims[None, :],
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    merged = tl.sum(part * weight[:, None], 0) / total
    tl.store(
        out_ptr + token * stride_o_t + head * stride_o_h + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    prefill_tiles: PrefillTiles | None = None,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context, in one launch.

    q [T, Hq, D]; k_cache / v_cache [num_blocks, block_size, Hkv, D]; out [T, Hq, D] (written);
    query_start_loc [B+1] int32; seq_lens [B] int32 (context after this step); block_tables
    [B, max_blocks] int32. Query token j of sequence i sits at position
    seq_lens[i] - qlen_i + j and sees positions <= its own. Rows of `out` for tokens outside
    every sequence (padding after query_start_loc[-1]) hold unspecified values.

    num_splits: None picks flash decoding by a heuristic (decode-only batches with long
    contexts and few sequences); 1 forces the single pass; > 1 forces that many splits. The
    heuristic reads the host ints max_query_len / max_seq_len, so a CUDA-graph capture should
    pass an explicit value; the kernels themselves read lengths from device memory only.

    window: each query sees only positions p - window + 1 .. p (its own p included); block
    table entries for blocks wholly before every query's window are never read. softcap: each
    scaled score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2). sinks:
    [Hq] sink logits (gpt-oss), each one more term of its head's softmax denominator.
    prefill_tiles: the launch configuration of steps with prefill chunks (default: 64-row
    tiles, 8 warps); decode-only steps keep theirs.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q heads {num_q_heads}x{head_dim} do not fit "
            f"cache heads {num_kv_heads}x{cache_head_dim}"
        )
    if (
        q.stride(-1) != 1
        or out.stride(-1) != 1
        or k_cache.stride(-1) != 1
        or v_cache.stride(-1) != 1
    ):
        raise ValueError("unified_attention needs the head dimension contiguous")
    check_device(_unified_attention_kernel, q, k_cache, v_cache, out, block_tables)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    queries_per_kv = num_q_heads // num_kv_heads
    head_dim_pad = padded_head_dim(head_dim)
    shape = _launch_shape(queries_per_kv, max_query_len, head_dim_pad, prefill_tiles)
    if num_splits is None:
        keys = max_seq_len if window is None else min(max_seq_len, window)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_query_len, keys, q.device)
    num_splits = max(int(num_splits), 1)

    if num_splits > 1:
        part_out = torch.empty(
            (num_tokens, num_q_heads, num_splits, head_dim_pad),
            dtype=torch.float32,
            device=q.device,
        )
        part_max = torch.empty(
            (num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=q.device
        )
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # never touched on this path

    upcast = dot_upcast(_unified_attention_kernel, k_cache.dtype)
    # fp32 and contiguous for the kernels' loads; a placeholder pointer where there are none
    sink_logits = out if sinks is None else sinks.float().contiguous()
    decode_only = max_query_len == 1
    # Without reading lengths, T // BLOCK_Q + B q-blocks always cover every sequence.
    num_q_blocks = num_seqs if decode_only else num_tokens // shape.block_q + num_seqs
    grid = (num_q_blocks, num_kv_heads, num_splits)
    _unified_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_max,
        part_sum,
        query_start_loc,
        seq_lens,
        block_tables,
        num_seqs,
        num_q_heads,
        scale * _LOG2E,
        window or 0,
        softcap or 0.0,
        sink_logits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_Q=shape.block_q,
        BLOCK_M=shape.block_m,
        TILE_N=shape.tile_n,
        NUM_SPLITS=num_splits,
        DECODE_ONLY=decode_only,
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        DOT_UPCAST=upcast,
        # fp32 caches get exact fp32 products (no TF32); half types use the default MMA.
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else None,
        num_warps=shape.num_warps,
        **({} if shape.num_stages is None else {"num_stages": shape.num_stages}),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            sink_logits,
            num_q_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=next_pow2(num_splits),
            SINKS=sinks is not None,
            num_warps=4,
        )
    return out
