"""w8a8: int8 weights, and calls of more than SMALL_ROWS rows quantize the activations to int8
per row too and multiply integers (engine.quantization.matmul); smaller calls stream the weight
through the weight-only kernel. The lm_head keeps exact activations: integer logits cost the
most quality of any layer, and serving computes them for a few rows per step, not a prompt's."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from engine.platforms.cpu.matmul import SMALL_ROWS
from engine.quantization.base import QuantizedLinearMethod, WeightSource
from engine.quantization.int8 import Int8Linear
from engine.quantization.weight_linear import QuantizedWeightLinear, onednn_tiles
from engine.quantization.weights import quantize_int8
from kernels.cpu_ops import LinearKind, NativeLinear

if TYPE_CHECKING:
    from engine.layers.linear import Linear


class W8A8Linear(QuantizedWeightLinear):
    source = WeightSource.QUANTIZE_AT_LOAD

    @classmethod
    def quantize(cls, name: str, weight: torch.Tensor, group_size: int) -> QuantizedLinearMethod:
        if name == "lm_head":
            return Int8Linear.quantize(name, weight, group_size)
        return W8A8Linear(replace(quantize_int8(weight), int8_activations=True))

    def weight_native_spec(self, layer: Linear) -> NativeLinear | None:
        weight = self.weight
        return NativeLinear(
            LinearKind.W8A8,
            weight.data,
            (weight.scales, None),
            bias=layer.bias,
            params=(SMALL_ROWS, int(onednn_tiles(layer)), 0),
        )
