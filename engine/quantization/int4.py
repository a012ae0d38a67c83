"""int4: group-wise asymmetric 4-bit weights (a scale and a minimum per group of inputs),
quantized at load. The lm_head gets int8: 4 bits there costs more quality than the rest of the
model together."""

from __future__ import annotations

import torch

from engine.quantization.base import QuantizedLinearMethod, WeightSource
from engine.quantization.errors import QuantizationError
from engine.quantization.int8 import Int8Linear
from engine.quantization.weight_linear import QuantizedWeightLinear
from engine.quantization.weights import Q4_BLOCK, quantize_int4


class Int4Linear(QuantizedWeightLinear):
    source = WeightSource.QUANTIZE_AT_LOAD

    @classmethod
    def check_input_sizes(cls, input_sizes: list[int], group_size: int) -> None:
        if group_size % Q4_BLOCK or any(size % group_size for size in input_sizes):
            raise QuantizationError(
                f"quantization_group_size={group_size} does not divide the input sizes of the "
                f"linear layers ({', '.join(map(str, input_sizes))}); supported: multiples of 32 "
                "that do"
            )

    @classmethod
    def quantize(cls, name: str, weight: torch.Tensor, group_size: int) -> QuantizedLinearMethod:
        if name == "lm_head":
            return Int8Linear.quantize(name, weight, group_size)
        return Int4Linear(quantize_int4(weight, group_size))
