"""The C++ CPU matmuls (kernels.quant_ops) against the plain-torch reference dequantization."""

from __future__ import annotations

import pytest
import torch

from engine.quantization.weights import (
    QuantizedWeight,
    dequantize,
    quantize_int4,
    quantize_int8,
)
from kernels import quant_ops

pytestmark = pytest.mark.skipif(
    not quant_ops.cpu_kernels_available(), reason="the C++ CPU kernels cannot be built here"
)

ROWS = (1, 3, 16, 17, 100)
OUT_FEATURES = 37  # not a multiple of the kernels' 4-row tiles
IN_FEATURES = 384  # divisible by 32, 64, 128


def _weights(group_size: int | None, bits: int) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(bits * 1000 + (group_size or 0))
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator)
    if bits == 8:
        quantized = quantize_int8(weight)  # per output channel
        if group_size is not None:  # per-group scales too (GGUF Q8_0 has groups of 32)
            groups = weight.reshape(OUT_FEATURES, -1, group_size)
            scale = (groups.abs().amax(-1) / 127).clamp(min=1e-8).half()
            q = torch.round(groups / scale.float()[..., None]).clamp(-128, 127).to(torch.int8)
            quantized = QuantizedWeight(
                8, OUT_FEATURES, IN_FEATURES, group_size, q.reshape(weight.shape), scale
            )
        return quantized
    return quantize_int4(weight, group_size or IN_FEATURES)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype and actual.shape == expected.shape
    # fp32: only the summation order differs; bf16: the output is rounded to 8 mantissa bits.
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    error = (actual.float() - expected).abs().max() / expected.abs().max()
    assert error < tolerance, f"relative error {error:.2e}"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_quant_matmul_matches_dequantized_weight(
    bits: int, group_size: int | None, dtype: torch.dtype, with_bias: bool
) -> None:
    weight = _weights(group_size, bits)
    reference_weight = dequantize(weight)
    generator = torch.Generator().manual_seed(7)
    bias = torch.randn(OUT_FEATURES, generator=generator).to(dtype) if with_bias else None
    for rows in ROWS:
        x = torch.randn(rows, IN_FEATURES, generator=generator).to(dtype)
        expected = x.float() @ reference_weight.T
        if bias is not None:
            expected = expected + bias.float()
        # Every path at every size: streaming through registers, and dequantize-then-GEMM
        # through torch's GEMM or oneDNN's.
        for gemm_min_rows, onednn_gemm in ((1, False), (1, True), (10**9, False)):
            actual = quant_ops.quant_matmul(
                x, weight.data, weight.scales, weight.mins, bits, weight.group_size, bias,
                gemm_min_rows=gemm_min_rows, onednn_gemm=onednn_gemm,
            )  # fmt: skip
            _close(actual, expected, dtype)


def test_quant_matmul_keeps_leading_dimensions() -> None:
    weight = _weights(32, 4)
    x = torch.randn(2, 5, IN_FEATURES)
    out = quant_ops.quant_matmul(x, weight.data, weight.scales, weight.mins, 4, 32)
    assert out.shape == (2, 5, OUT_FEATURES)
    _close(out, x @ dequantize(weight).T, torch.float32)


def test_quant_matmul_default_crossover_matches_the_python_constant() -> None:
    schema = torch.ops.inferq_cpu.quant_matmul.default._schema
    (argument,) = [a for a in schema.arguments if a.name == "gemm_min_rows"]
    assert argument.default_value == quant_ops.QUANT_GEMM_MIN_ROWS


@pytest.mark.parametrize("bits", [4, 8])
def test_quant_dequantize_matches_reference(bits: int) -> None:
    weight = _weights(64, bits)
    actual = quant_ops.quant_dequantize(
        weight.data, weight.scales, weight.mins, bits, weight.group_size
    )
    torch.testing.assert_close(actual, dequantize(weight), rtol=1e-6, atol=1e-6)


def test_quant_matmul_rejects_groups_not_dividing_inputs() -> None:
    weight = _weights(32, 4)
    with pytest.raises(RuntimeError, match="group_size"):
        quant_ops.quant_matmul(
            torch.randn(1, IN_FEATURES), weight.data, weight.scales, weight.mins, 4, 48
        )


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [IN_FEATURES, 100])  # 100: the at::linear fallback
def test_dense_matmul_matches_linear(
    weight_dtype: torch.dtype, x_dtype: torch.dtype, in_features: int
) -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(OUT_FEATURES, in_features, generator=generator).to(weight_dtype)
    bias = torch.randn(OUT_FEATURES, generator=generator)
    for rows in (1, 3, 16, 17):
        x = torch.randn(rows, in_features, generator=generator).to(x_dtype)
        expected = x.float() @ weight.float().T + bias
        _close(quant_ops.dense_matmul(x, weight, bias), expected, x_dtype)
