"""x @ W.T for float8_e4m3fn weights, by one of two kernels chosen once per device by measurement.

- SCALED_MM, w8a8-fp8: each row of x is scaled into fp8 on the fly (its own scale, dynamic per
  token, or the checkpoint's static input scale) and torch._scaled_mm multiplies fp8 by fp8,
  accumulating in higher precision, scaled per row and per output channel. Only for weights with
  one scale per output channel; block-scaled weights take the upcast.
- UPCAST, weight-only: blocks of the weight's output rows are upcast to the activations' dtype
  and multiplied in full precision, so activations stay exact and the numbers are the dequantized
  model's up to summation order. Blocks keep the upcast tile in cache instead of a whole copy.

torch's own fp8 -> float conversion is slow on CPUs; the upcast moves e4m3's sign, exponent and
mantissa bits into a bfloat16's with two integer operations. Shifted by 4 they read as the value
times 2^-120, for normal and subnormal numbers alike (the exponent biases differ by 120); the
2^120 is folded into the scales. (No quantizer writes e4m3fn's one NaN code.)

Whether _scaled_mm runs on a device for an activation dtype, and whether it beats the upcast
there, is measured once (`fp8_kernel`: as weights are quantized at load, else at the engine's
start-up forward), not inferred from the device's name or vendor.
"""

from __future__ import annotations

import enum
import functools
import logging
import time

import torch

from engine.quantization.weights import FP8, FP8_MAX, QuantizedWeight

logger = logging.getLogger(__name__)

_UPCAST_FACTOR = 2.0**120  # the upcast's bf16 bits read as the fp8 value times 2^-120
_BLOCK_ELEMENTS = 1 << 18  # weight elements upcast at once (1 MiB as fp32)
_PROBE_SHAPE = (1024, 1024)  # (out, in) of the weight the choice is measured on
_PROBE_ROWS = (1, 64)  # a decode step's and a prefill chunk's rows


class Fp8Kernel(enum.Enum):
    SCALED_MM = "w8a8-fp8 (torch._scaled_mm, dynamic per-token activation scales)"
    UPCAST = "weight-only (fp8 weights upcast in blocks, exact activations)"


def fp8_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    kernel: Fp8Kernel = Fp8Kernel.UPCAST,
) -> torch.Tensor:
    """x [..., in] @ dequantize(weight).T + bias in x's dtype, by `kernel` where the weight
    suits it (SCALED_MM needs one scale per output channel), else by the upcast."""
    rows = x.reshape(-1, weight.in_features)
    if kernel is Fp8Kernel.SCALED_MM and scaled_mm_suits(weight):
        out = _scaled_mm_linear(rows, weight, bias)
    else:
        out = _upcast_linear(rows, weight, bias)
    return out.reshape(*x.shape[:-1], weight.out_features)


def _scaled_mm_linear(
    rows: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    if weight.input_scale is not None:  # the checkpoint's static scale, for every row
        row_scales = weight.input_scale.float().reshape(1, 1).expand(rows.shape[0], 1)
    else:
        row_scales = (rows.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    quantized_rows = (rows.float() / row_scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch._scaled_mm(
        quantized_rows,
        weight.data.t(),
        scale_a=row_scales.contiguous(),
        scale_b=weight.scales.reshape(1, -1).float().contiguous(),
        bias=bias,
        out_dtype=rows.dtype,
    )


def scaled_mm_suits(weight: QuantizedWeight) -> bool:
    """Whether torch._scaled_mm can multiply by the weight: one scale per output channel, and
    sizes of a multiple of 16 (what CUDA's fp8 GEMMs ask)."""
    return (
        weight.group_size == weight.in_features
        and weight.in_features % 16 == 0
        and weight.out_features % 16 == 0
    )


def upcast_bits(data: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3fn [...] -> bfloat16 [...] holding each value times 2^-120 (exactly)."""
    codes = data.view(torch.uint8).to(torch.int16)
    return (((codes & 0x7F) << 4) | ((codes & 0x80) << 8)).view(torch.bfloat16)


def _upcast_linear(
    rows: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    out = torch.empty(rows.shape[0], weight.out_features, dtype=rows.dtype, device=rows.device)
    block = max(1, _BLOCK_ELEMENTS // weight.in_features)
    groups = weight.in_features // weight.group_size
    per_channel = groups == 1
    for start in range(0, weight.out_features, block):
        stop = min(start + block, weight.out_features)
        tile = upcast_bits(weight.data[start:stop]).to(rows.dtype)
        scales = weight.scales[start:stop].to(rows.dtype) * _UPCAST_FACTOR
        if per_channel:  # scaling the outputs costs rows x block, not the tile's size
            out[:, start:stop] = (rows @ tile.t()).mul_(scales.reshape(1, -1))
        else:
            tile = tile.reshape(stop - start, groups, weight.group_size) * scales[..., None]
            out[:, start:stop] = rows @ tile.reshape(stop - start, -1).t()
    if bias is not None:
        out += bias.to(rows.dtype)
    return out


def fp8_kernel(device: torch.device, dtype: torch.dtype) -> Fp8Kernel:
    """The faster fp8 kernel for activations of `dtype` on `device` (measured once each;
    UPCAST where _scaled_mm does not run)."""
    return _measured_kernel(device.type, device.index, dtype)


@functools.cache
def _measured_kernel(device_type: str, index: int | None, dtype: torch.dtype) -> Fp8Kernel:
    device = torch.device(device_type, index)
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = _PROBE_SHAPE
    full = torch.randn(out_features, in_features, generator=generator) * 0.05
    scales = (full.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    probe = QuantizedWeight(
        8, out_features, in_features, in_features, (full / scales).to(FP8), scales
    ).to(device)
    timings: dict[Fp8Kernel, float] = {}
    for kernel in Fp8Kernel:
        try:
            timings[kernel] = sum(
                _time_call(
                    kernel, probe, torch.randn(rows, in_features, device=device, dtype=dtype)
                )
                for rows in _PROBE_ROWS
            )
        except (RuntimeError, NotImplementedError) as error:  # no fp8 GEMM on this device
            logger.info("torch._scaled_mm does not run fp8 on %s for %s (%s)", device, dtype, error)
    chosen = min(timings, key=timings.__getitem__)
    logger.info(
        "fp8 on %s, %s activations: %s (measured ms per probe: %s)",
        device,
        dtype,
        chosen.value,
        ", ".join(f"{k.name} {v * 1e3:.2f}" for k, v in timings.items()),
    )
    return chosen


def _time_call(kernel: Fp8Kernel, weight: QuantizedWeight, x: torch.Tensor) -> float:
    """Best of a few calls' seconds, after one warm-up call."""
    best = float("inf")
    for _ in range(4):
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        fp8_linear(x, weight, kernel=kernel)
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        best = min(best, time.perf_counter() - start)
    return best
