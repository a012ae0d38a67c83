"""CPU matmuls for quantized (int8, int4) and dense (fp32, bf16) linear weights.

The C++ ops live in kernels/cpu/small_matmul.cpp, built with the other CPU kernels by
kernels.cpu_ops; call them only where `cpu_kernels_available()` is True.

Weights come in the layout of engine.quantization.weights.QuantizedWeight, passed as its
tensors (kernels import nothing from the engine):

- 8 bits: data int8 [out, in]; weight = q * scale.
- 4 bits: data uint8 [out, in // 2], each 32 inputs 16 bytes, low nibbles inputs 0..15 and high
  nibbles 16..31 (GGUF's Q4 order); weight = q * scale + min.
- scales (and mins) float16 [out, in // group_size]; group_size a multiple of 32 dividing in.

The kernels never quantize activations: the result is `x.float() @ dequantize(w).T + bias` up to
fp32 summation order, in x's dtype. A weight with an `input_order` (GPTQ act-order) needs
`x[..., input_order]` passed as x.
"""

from __future__ import annotations

import torch

from kernels.cpu_ops import QUANT_GEMM_MIN_ROWS, cpu_kernels_available

__all__ = [
    "QUANT_GEMM_MIN_ROWS",
    "cpu_kernels_available",
    "dense_matmul",
    "quant_dequantize",
    "quant_matmul",
    "w8a8_matmul",
]


def quant_matmul(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    gemm_min_rows: int = QUANT_GEMM_MIN_ROWS,
    onednn_gemm: bool = False,
) -> torch.Tensor:
    """x [..., in] (fp32 or bf16) @ the quantized weight's transpose (+ bias) -> [..., out].

    mins is required for bits=4 and ignored (pass None) for bits=8. gemm_min_rows overrides the
    row count from which the dequantize-then-GEMM path runs (for measuring the crossover);
    onednn_gemm runs that path's GEMMs through oneDNN instead of torch's default (MKL for fp32).
    """
    return torch.ops.inferq_cpu.quant_matmul(
        x.contiguous(), data, scales, mins, bits, group_size, bias, gemm_min_rows, onednn_gemm
    )


def quant_dequantize(
    data: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """The fp32 [out, in] weight of a quantized one (what dequantize() computes, in parallel)."""
    return torch.ops.inferq_cpu.quant_dequantize(data, scales, mins, bits, group_size)


def dense_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] (fp32 or bf16) @ weight.T (+ bias) for a plain fp32 or bf16 weight [out, in].

    Made for decode-sized calls (1-16 rows), where it streams the weight once per call and
    computes in fp32; prefill-sized calls belong to F.linear / oneDNN.
    """
    return torch.ops.inferq_cpu.dense_matmul(x.contiguous(), weight, bias)


def w8a8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., in] (fp32 or bf16) quantized to int8 per row (scale max|row| / 127, round half to
    even) @ int8 weight [out, in].T, scaled back by the row's and the channel's scale
    (weight_scales float16, one per output), + bias; in x's dtype."""
    return torch.ops.inferq_cpu.w8a8_matmul(x, weight, weight_scales, bias)
