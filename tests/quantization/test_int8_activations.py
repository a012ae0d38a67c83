"""W8A8: calls of many rows quantize activations per row and multiply integers; decode-sized
calls keep exact activations."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.platforms.cpu.matmul import SMALL_ROWS
from engine.quantization import matmul as int8_matmul
from engine.quantization.matmul import quantized_linear
from engine.quantization.weights import QuantizedWeight, dequantize, quantize_int8
from kernels.cpu_ops import cpu_kernels_available


def _w8a8(out_features: int, in_features: int) -> QuantizedWeight:
    torch.manual_seed(0)
    weight = quantize_int8(torch.randn(out_features, in_features) / in_features**0.5)
    return replace(weight, int8_activations=True)


def _fake_quantized_rows(x: torch.Tensor) -> torch.Tensor:
    scales = x.abs().amax(dim=1, keepdim=True) / 127
    return torch.round(x / scales) * scales  # in float64: no tie of the float32 codes differs


@pytest.mark.parametrize("kernels", [True, False], ids=["cpp", "torch"])
def test_many_rows_multiply_int8_activations(
    kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kernels and not cpu_kernels_available():
        pytest.skip("the CPU kernels need a C++ compiler")
    monkeypatch.setattr(int8_matmul, "cpu_kernels_available", lambda: kernels)
    weight = _w8a8(96, 64)
    bias = torch.randn(96)
    x = torch.randn(SMALL_ROWS + 5, 64)
    got = quantized_linear(x, weight, bias)
    w = dequantize(weight).double()
    expected = _fake_quantized_rows(x.double()) @ w.T + bias.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    exact = x.double() @ w.T + bias.double()
    assert not torch.allclose(got.double(), exact, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not cpu_kernels_available(), reason="the CPU kernels need a C++ compiler")
def test_decode_sized_calls_keep_exact_activations() -> None:
    weight = _w8a8(96, 64)
    weight_only = QuantizedWeight(8, 96, 64, 64, weight.data, weight.scales)
    x = torch.randn(SMALL_ROWS, 64)
    torch.testing.assert_close(quantized_linear(x, weight), quantized_linear(x, weight_only))


def test_int8_activations_need_per_row_int8_weights() -> None:
    weight = quantize_int8(torch.randn(8, 64))
    with pytest.raises(ValueError, match="one scale per row"):
        QuantizedWeight(8, 8, 64, 32, weight.data, torch.ones(8, 2).half(), int8_activations=True)


@pytest.mark.skipif(not cpu_kernels_available(), reason="the CPU kernels need a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_kernel_computes_the_torch_reference(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    weight = _w8a8(200, 128)
    x = (3 * torch.randn(2, 40, 128)).to(dtype)
    bias = torch.randn(200)
    got = quantized_linear(x, weight, bias)
    monkeypatch.setattr(int8_matmul, "cpu_kernels_available", lambda: False)
    expected = quantized_linear(x, weight, bias)
    assert got.dtype == dtype and got.shape == (2, 40, 200)
    # fp32: the same codes and products, up to the order of the last multiplications; bf16:
    # that order may flip the final rounding to 8 mantissa bits.
    tolerance = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance * 4)
