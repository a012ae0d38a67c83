"""Dequantize-GEMM on CUDA: x @ W^T (+ bias) for int8 and int4 weights, dequantized in registers.

The weight comes as the tensors of engine.quantization.weights.QuantizedWeight (kernels import
nothing from the engine):

- 8 bits: data int8 [out, in]; weight = q * scale.
- 4 bits: data uint8 [out, in // 2], each run of 32 inputs 16 bytes, low nibbles inputs 0..15
  and high nibbles 16..31 (GGUF's Q4 order); weight = q * scale + min.
- scales (and mins) float16 [out, in // group_size]; group_size a multiple of 32, or in_features
  (one group per output channel).

Every K tile lies inside one group, so the kernel multiplies x by the raw integers q (exact in
fp16/bf16/fp32) and applies the group's scale to the tile's fp32 partial product, and its min to
the tile's row sums of x: sum_k x*(q*s + m) = s * sum_k x*q + m * sum_k x. The weight is never
rounded to the activation dtype, so the result matches `x.float() @ dequantize(w).T` up to fp32
summation order. A weight with an `input_order` (GPTQ act-order) needs `x[..., input_order]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._launch import check_device, dot_upcast, next_pow2, num_compute_units

Q4_RUN = 32  # inputs per packed 4-bit run: 16 bytes, low nibbles first
_MIN_BLOCK_K = Q4_RUN  # one packed run; also a multiple of tl.dot's minimum K of 16


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    data_ptr,
    scales_ptr,
    mins_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_dn,
    stride_sn,
    stride_mn,
    stride_om,
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < M
    col_valid = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = data_ptr + cols.to(tl.int64)[None, :] * stride_dn
    scale_cols = scales_ptr + cols.to(tl.int64) * stride_sn
    min_cols = mins_ptr + cols.to(tl.int64) * stride_mn
    dot_dtype = tl.float32 if DOT_UPCAST else x_ptr.dtype.element_ty

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BITS == 4:
        # Byte b of a tile holds input (b // 16) * 32 + b % 16 in its low nibble, +16 in its high.
        byte = tl.arange(0, BLOCK_K // 2)
        lo_inputs = (byte // 16) * 32 + byte % 16
        for k0 in range(0, K, BLOCK_K):
            k_lo = k0 + lo_inputs
            x_mask = row_valid[:, None]
            w_mask = col_valid[None, :]
            if not EVEN_K:  # only a single-group weight has a ragged last tile (whole runs)
                x_mask = x_mask & (k_lo < K)[None, :]
                w_mask = w_mask & (k_lo < K)[:, None]
            x_lo = tl.load(x_rows + k_lo[None, :], mask=x_mask, other=0.0)
            x_hi = tl.load(x_rows + (k_lo + 16)[None, :], mask=x_mask, other=0.0)
            packed = tl.load(w_cols + (k0 // 2 + byte)[:, None], mask=w_mask, other=0)
            q_lo = (packed & 0xF).to(dot_dtype)
            q_hi = (packed >> 4).to(dot_dtype)
            partial = tl.dot(x_lo.to(dot_dtype), q_lo, input_precision=DOT_PRECISION)
            partial = tl.dot(x_hi.to(dot_dtype), q_hi, partial, input_precision=DOT_PRECISION)
            group = k0 // group_size
            scale = tl.load(scale_cols + group, mask=col_valid, other=0.0).to(tl.float32)
            low = tl.load(min_cols + group, mask=col_valid, other=0.0).to(tl.float32)
            x_sum = tl.sum(x_lo.to(tl.float32), 1) + tl.sum(x_hi.to(tl.float32), 1)
            acc += partial * scale[None, :] + x_sum[:, None] * low[None, :]
    else:
        inputs = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + inputs
            x_mask = row_valid[:, None]
            w_mask = col_valid[None, :]
            if not EVEN_K:
                x_mask = x_mask & (k < K)[None, :]
                w_mask = w_mask & (k < K)[:, None]
            x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0).to(dot_dtype)
            q = tl.load(w_cols + k[:, None], mask=w_mask, other=0).to(dot_dtype)
            partial = tl.dot(x, q, input_precision=DOT_PRECISION)
            scale = tl.load(scale_cols + k0 // group_size, mask=col_valid, other=0.0)
            acc += partial * scale.to(tl.float32)[None, :]

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    out_offsets = rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    out_mask = row_valid[:, None] & col_valid[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def choose_tiles(
    rows: int, out_features: int, in_features: int, group_size: int, compute_units: int
) -> TileConfig:
    """A fixed table keyed by rows: decode streams the weight, prefill reuses it across rows.

    Decode (<= 16 rows) is bound by weight bytes: tl.dot's minimum of 16 rows, long K tiles,
    and narrower N tiles when 64-wide ones would leave streaming multiprocessors idle. Prefill
    takes 64- or 128-row tiles so each dequantized weight tile serves many rows. BLOCK_K must
    divide the group (each tile reads one scale per output) unless there is a single group.
    """
    if rows <= 16:
        block_m, block_n, block_k, num_warps, num_stages = 16, 64, 128, 4, 4
        if triton.cdiv(out_features, block_n) < compute_units:
            block_n = 32
    elif rows <= 64:
        block_m, block_n, block_k, num_warps, num_stages = next_pow2(rows), 64, 64, 4, 4
    else:
        block_m, block_n, block_k, num_warps, num_stages = 128, 128, 64, 8, 3
    if group_size == in_features:
        block_k = max(_MIN_BLOCK_K, min(block_k, next_pow2(in_features)))
    else:
        while group_size % block_k:
            block_k //= 2
    return TileConfig(block_m, block_n, block_k, num_warps, num_stages)


def _check_weight(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> None:
    in_features = x.shape[-1]
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    if bits == 4 and mins is None:
        raise ValueError("4-bit weights need mins")
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {in_features}")
    if group_size % Q4_RUN and group_size != in_features:
        raise ValueError(f"group_size {group_size} is neither a multiple of 32 nor per-channel")
    if bits == 4 and in_features % Q4_RUN:
        raise ValueError(f"4-bit weights need in_features a multiple of 32, not {in_features}")
    packed_in = in_features // 2 if bits == 4 else in_features
    if data.dim() != 2 or data.shape[1] != packed_in:
        raise ValueError(f"{bits}-bit data of shape {tuple(data.shape)} for {in_features} inputs")
    groups = (data.shape[0], in_features // group_size)
    for name, part in (("scales", scales), ("mins", mins if bits == 4 else None)):
        if part is not None and tuple(part.shape) != groups:
            raise ValueError(f"{name} has shape {tuple(part.shape)}, not {groups}")


def quant_matmul_triton(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., in] (fp16, bf16 or fp32) @ the quantized weight's transpose (+ bias) -> [..., out].

    Accumulates in fp32 and returns x's dtype. mins is required for bits=4 and ignored for
    bits=8. A 4-bit weight's data is [out, in // 2] packed bytes; an 8-bit one's [out, in] int8.
    """
    _check_weight(x, data, scales, mins, bits, group_size)
    check_device(_quant_matmul_kernel, x, data, scales)
    in_features, out_features = x.shape[-1], data.shape[0]
    x2d = x.reshape(-1, in_features)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    data, scales = data.contiguous(), scales.contiguous()
    mins = mins.contiguous() if bits == 4 and mins is not None else scales  # unused for 8 bits
    out = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype, device=x.device)
    out2d = out.view(-1, out_features)
    rows = x2d.shape[0]
    if rows == 0 or out_features == 0:
        return out

    tiles = choose_tiles(rows, out_features, in_features, group_size, num_compute_units(x.device))
    grid = (triton.cdiv(rows, tiles.block_m), triton.cdiv(out_features, tiles.block_n))
    _quant_matmul_kernel[grid](
        x2d,
        data,
        scales,
        mins,
        bias.contiguous() if bias is not None else scales,  # unused without HAS_BIAS
        out2d,
        rows,
        out_features,
        in_features,
        group_size,
        x2d.stride(0),
        data.stride(0),
        scales.stride(0),
        mins.stride(0),
        out2d.stride(0),
        BITS=bits,
        HAS_BIAS=bias is not None,
        EVEN_K=in_features % tiles.block_k == 0,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        DOT_UPCAST=dot_upcast(_quant_matmul_kernel, x.dtype),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
