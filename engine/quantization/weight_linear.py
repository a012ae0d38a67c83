"""A layer whose weight is a `QuantizedWeight`, multiplied by engine.quantization.matmul: the
method every built-in scheme (int8, int4, w8a8, fp8, GGUF, GPTQ, AWQ) subclasses.

On the CPU a layer that keeps its full-precision weight anyway (an lm_head tied to the
embedding) computes calls of more than SMALL_ROWS rows from it: such calls are bound by
arithmetic, where the weight's bytes do not matter and dequantizing costs; decode-sized calls
stream the smaller integer weight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Self

import torch

from engine.platforms.cpu.matmul import ONEDNN_BACKENDS, SMALL_ROWS
from engine.quantization.base import QuantizedLinearMethod
from engine.quantization.matmul import quantized_linear
from engine.quantization.weights import QuantizedWeight
from kernels.cpu_ops import LinearKind, NativeLinear

if TYPE_CHECKING:
    from engine.layers.linear import Linear


class QuantizedWeightLinear(QuantizedLinearMethod):
    """x @ dequantize(weight).T through the quantized matmul kernels (abstract: each scheme
    subclasses it with how its weights come to be, and its C++ spec where that differs)."""

    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight = weight

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    @classmethod
    def from_checkpoint(cls, weight: QuantizedWeight) -> Self:
        return cls(weight)

    def to(self, device: torch.device) -> Self:
        return type(self)(self.weight.to(device))

    def weight_tensors(self) -> list[torch.Tensor]:
        return self.weight.tensors()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and uses_plain_weight(layer, x.numel() // layer.in_features):
            return layer.plain(x, layer.plan.plain())
        return quantized_linear(x, self.weight, layer.bias, onednn_tiles(layer))

    def native_spec(self, layer: Linear, rows: int) -> NativeLinear | None:
        if uses_plain_weight(layer, rows):
            return layer.plain_native_spec(layer.plan.plain(), rows)
        return self.weight_native_spec(layer)

    def weight_native_spec(self, layer: Linear) -> NativeLinear | None:
        """The spec of a call that reads the quantized weight (weight-only integer kernel)."""
        weight = self.weight
        return NativeLinear(
            LinearKind.QUANT,
            weight.data,
            (weight.scales, weight.mins),
            weight.input_order,
            layer.bias,
            (weight.bits, weight.group_size, int(onednn_tiles(layer))),
        )


def uses_plain_weight(layer: Linear, rows: int) -> bool:
    """Whether a quantized layer computes a CPU call of `rows` rows from the full-precision
    weight it keeps (see the module's docstring)."""
    return layer.weight.device.type == "cpu" and rows > SMALL_ROWS


def onednn_tiles(layer: Linear) -> bool:
    """Whether calls of many rows multiply dequantized tiles through oneDNN (as the layer's
    plan chose for large calls) rather than torch's default GEMM."""
    return layer.plan.large in ONEDNN_BACKENDS
