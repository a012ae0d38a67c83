"""x @ W.T for a quantized W: the C++ kernels on the CPU, a Triton dequantize-GEMM on CUDA
(fp8 weights: engine.quantization.fp8_matmul).

Both compute in full precision from the integer codes (no activation quantization), so a
quantized model gives the numbers of its dequantized full-precision twin up to summation order.
Where neither kernel runs (a CPU without a compiler, which kernels.cpu_ops says once in the log),
the weight is dequantized per call: the same numbers, slowly.

The one exception is W8A8 (`int8_activations`): a call of many rows (prefill, large decode
batches) is bound by arithmetic, not by weight bytes, and there full-precision arithmetic on
dequantized weights cannot beat full precision. So such calls quantize each row of x to int8
(symmetric, its own scale) and multiply integers with torch._int_mm (oneDNN's VNNI / AMX
kernels on the CPU), scaling the int32 sums by the row's and the channel's scales. Calls of up
to SMALL_ROWS rows stream the weight through the weight-only kernel: activations stay exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.platforms.cpu.matmul import SMALL_ROWS
from engine.quantization.fp8_matmul import fp8_kernel, fp8_linear
from engine.quantization.weights import QuantizedWeight, dequantize
from kernels import quant_ops
from kernels.cpu_ops import cpu_kernels_available


def quantized_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    onednn_tiles: bool = False,
) -> torch.Tensor:
    """x [..., in] @ dequantize(weight).T + bias, in x's dtype. onednn_tiles: on the CPU, calls
    of many rows multiply dequantized tiles through oneDNN (else torch's default GEMM)."""
    if weight.is_fp8:
        return fp8_linear(x, weight, bias, fp8_kernel(x.device, x.dtype))
    if weight.int8_activations and x.numel() > SMALL_ROWS * weight.in_features:
        return int8_activation_linear(x, weight, bias)
    if x.device.type == "cpu" and x.numel() and cpu_kernels_available():
        if weight.input_order is not None:
            x = x.index_select(-1, weight.input_order)
        rows = x.reshape(-1, weight.in_features).contiguous()
        out = quant_ops.quant_matmul(
            rows,
            weight.data,
            weight.scales,
            weight.mins,
            weight.bits,
            weight.group_size,
            bias,
            onednn_gemm=onednn_tiles,
        )
        return out.reshape(*x.shape[:-1], weight.out_features)
    if x.device.type == "cuda":
        from kernels import quant_matmul_triton

        if weight.input_order is not None:
            x = x.index_select(-1, weight.input_order)
        return quant_matmul_triton(
            x, weight.data, weight.scales, weight.mins, weight.bits, weight.group_size, bias
        )
    return F.linear(x, dequantize(weight, x.dtype), bias)


_INV_127 = torch.tensor(1 / 127, dtype=torch.float32)


def int8_activation_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W.T with x quantized to int8 per row on the fly (W int8, one scale per row)."""
    if x.device.type == "cpu" and cpu_kernels_available():
        return quant_ops.w8a8_matmul(x, weight.data, weight.scales, bias)
    rows = x.reshape(-1, weight.in_features).float()
    # Products with reciprocals, as the C++ kernel computes them (the same codes, ties too).
    row_scales = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) * _INV_127
    quantized_rows = torch.round(rows * (1 / row_scales)).to(torch.int8)
    sums = torch._int_mm(quantized_rows, weight.data.t())
    out = sums.float().mul_(row_scales).mul_(weight.scales.reshape(1, -1).float())
    if bias is not None:
        out.add_(bias.float())
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)


def quantized_embedding(ids: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """Rows `ids` of a quantized [vocab, hidden] table, dequantized to float32."""
    if weight.input_order is not None:
        raise ValueError("an embedding table cannot have a reordered hidden dimension")
    rows = QuantizedWeight(
        weight.bits,
        ids.numel(),
        weight.in_features,
        weight.group_size,
        weight.data.index_select(0, ids.reshape(-1)),
        weight.scales.index_select(0, ids.reshape(-1)),
        None if weight.mins is None else weight.mins.index_select(0, ids.reshape(-1)),
    )
    return dequantize(rows).reshape(*ids.shape, weight.in_features)
