"""int8: symmetric per-output-channel int8 weights, quantized at load; exact activations."""

from __future__ import annotations

import torch

from engine.quantization.base import WeightSource
from engine.quantization.weight_linear import QuantizedWeightLinear
from engine.quantization.weights import quantize_int8


class Int8Linear(QuantizedWeightLinear):
    source = WeightSource.QUANTIZE_AT_LOAD

    @classmethod
    def quantize(cls, name: str, weight: torch.Tensor, group_size: int) -> Int8Linear:
        return Int8Linear(quantize_int8(weight))
