"""quant_matmul_triton (the CUDA dequantize-GEMM) against the engine's dequantized weight.

On a CPU-only machine these run the Triton kernel under TRITON_INTERPRET=1 (see conftest).
"""

from __future__ import annotations

import pytest
import torch

from engine.quantization.weights import QuantizedWeight, dequantize, pack_int4
from kernels.reference import quant_matmul_triton_ref

pytest.importorskip("triton")

OUT_FEATURES = 40  # not a multiple of any BLOCK_N: the last output tile is partly masked
TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    # The interpreter truncates fp32 -> bf16 where GPUs round to nearest: allow one ulp.
    torch.bfloat16: {"atol": 1e-2, "rtol": 2**-7},
}


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_weight(
    bits: int, out_features: int, in_features: int, group_size: int, device: torch.device
) -> QuantizedWeight:
    """Random codes and fp16 scales (and mins) in the layout of QuantizedWeight."""
    groups = in_features // group_size
    scales = (torch.rand(out_features, groups, generator=_generator(1)) * 0.02 + 0.005).half()
    if bits == 4:
        q = torch.randint(0, 16, (out_features, in_features), generator=_generator(2))
        data = pack_int4(q)
        mins = (torch.rand(out_features, groups, generator=_generator(3)) * -0.15).half()
    else:
        q = torch.randint(-128, 128, (out_features, in_features), generator=_generator(2))
        data, mins = q.to(torch.int8), None
    return QuantizedWeight(bits, out_features, in_features, group_size, data, scales, mins).to(
        device
    )


def _expected(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ dequantize(weight).T
    return out if bias is None else out + bias.float()


def _run(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    from kernels import quant_matmul_triton

    return quant_matmul_triton(
        x, weight.data, weight.scales, weight.mins, weight.bits, weight.group_size, bias
    )


def _assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


# (bits, in_features, group_size): groups of 32/64/128 and per-channel, including a
# per-channel in_features that is no power of two (the last K tile is partly masked).
WEIGHTS = [
    (4, 256, 32),
    (4, 256, 64),
    (4, 256, 128),
    (4, 96, 96),
    (8, 256, 32),
    (8, 256, 128),
    (8, 256, 256),
    (8, 80, 80),
]


@pytest.mark.parametrize(("bits", "in_features", "group_size"), WEIGHTS)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_matches_dequantized_weight_fp32(bits, in_features, group_size, rows, device):
    weight = _random_weight(bits, OUT_FEATURES, in_features, group_size, device)
    x = torch.randn(rows, in_features, generator=_generator(4)).to(device)
    _assert_matches(_run(x, weight, None), _expected(x, weight, None), torch.float32)


@pytest.mark.parametrize(("bits", "in_features", "group_size"), WEIGHTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_half_precision_activations(bits, in_features, group_size, dtype, with_bias, device):
    weight = _random_weight(bits, OUT_FEATURES, in_features, group_size, device)
    x = torch.randn(5, in_features, generator=_generator(5)).to(dtype).to(device)
    bias = torch.randn(OUT_FEATURES, generator=_generator(6)).to(dtype).to(device)
    bias = bias if with_bias else None
    _assert_matches(_run(x, weight, bias), _expected(x, weight, bias), dtype)


@pytest.mark.parametrize("bits", [4, 8])
def test_bias_is_added_in_fp32(bits, device):
    weight = _random_weight(bits, OUT_FEATURES, 128, 32, device)
    x = torch.randn(3, 128, generator=_generator(7)).to(device)
    bias = torch.randn(OUT_FEATURES, generator=_generator(8)).to(device)
    _assert_matches(_run(x, weight, bias), _expected(x, weight, bias), torch.float32)


@pytest.mark.parametrize("bits", [4, 8])
def test_prefill_tiles_and_leading_dims(bits, device):
    """More than 64 rows takes the 128-row tiles; [..., in] inputs keep their leading dims."""
    weight = _random_weight(bits, 72, 128, 64, device)
    x = torch.randn(2, 70, 128, generator=_generator(9)).to(device)
    out = _run(x, weight, None)
    assert out.shape == (2, 70, 72)
    _assert_matches(out.reshape(-1, 72), _expected(x.reshape(-1, 128), weight, None), torch.float32)


@pytest.mark.parametrize(("bits", "in_features", "group_size"), [(4, 256, 64), (8, 80, 80)])
def test_reference_twin_matches_engine_dequantize(bits, in_features, group_size):
    weight = _random_weight(bits, OUT_FEATURES, in_features, group_size, torch.device("cpu"))
    x = torch.randn(4, in_features, generator=_generator(10))
    bias = torch.randn(OUT_FEATURES, generator=_generator(11))
    out = quant_matmul_triton_ref(
        x, weight.data, weight.scales, weight.mins, bits, group_size, bias
    )
    torch.testing.assert_close(out, _expected(x, weight, bias))


def test_no_rows_gives_an_empty_result(device):
    weight = _random_weight(4, OUT_FEATURES, 64, 32, device)
    out = _run(torch.zeros(0, 64, device=device), weight, None)
    assert out.shape == (0, OUT_FEATURES)


def test_rejects_4_bit_weight_without_mins(device):
    from kernels import quant_matmul_triton

    weight = _random_weight(4, OUT_FEATURES, 64, 32, device)
    with pytest.raises(ValueError, match="mins"):
        quant_matmul_triton(
            torch.zeros(1, 64, device=device), weight.data, weight.scales, None, 4, 32
        )


def test_rejects_group_that_is_neither_multiple_of_32_nor_per_channel(device):
    from kernels import quant_matmul_triton

    data = torch.zeros(OUT_FEATURES, 96, dtype=torch.int8, device=device)
    scales = torch.ones(OUT_FEATURES, 2, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="group_size"):
        quant_matmul_triton(torch.zeros(1, 96, device=device), data, scales, None, 8, 48)
