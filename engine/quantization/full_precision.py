"""Full precision: the layer's own weight, through its CPU matmul plan (engine.platforms.cpu.matmul)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.quantization.base import LinearMethod

if TYPE_CHECKING:
    from engine.layers.linear import Linear
    from kernels.cpu_ops import NativeLinear


class FullPrecisionLinear(LinearMethod):
    """x @ weight.T + bias on the layer's plain weight, through the layer's plan."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return layer.plain(x, layer.plan)

    def native_spec(self, layer: Linear, rows: int) -> NativeLinear | None:
        return layer.plain_native_spec(layer.plan, rows)

    def weight_tensors(self) -> list[torch.Tensor]:
        return []  # the weight is the layer's parameter


FULL_PRECISION = FullPrecisionLinear()
