"""fp8 (CUDA): float8_e4m3fn weights with a scale per output channel, quantized at load; each
call scales its rows into fp8 too and multiplies with torch._scaled_mm."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from engine.quantization.base import WeightSource
from engine.quantization.weight_linear import QuantizedWeightLinear
from engine.quantization.weights import quantize_fp8

if TYPE_CHECKING:
    from engine.layers.linear import Linear
    from kernels.cpu_ops import NativeLinear


class Fp8Linear(QuantizedWeightLinear):
    source = WeightSource.QUANTIZE_AT_LOAD
    runs_on_cpu = False
    activation_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None

    @classmethod
    def quantize(cls, name: str, weight: torch.Tensor, group_size: int) -> Fp8Linear:
        return Fp8Linear(quantize_fp8(weight))

    def weight_native_spec(self, layer: Linear) -> NativeLinear | None:
        return None  # no CPU kernel multiplies fp8
