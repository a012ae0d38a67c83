"""fp8: float8_e4m3fn weights, on the CPU and CUDA.

Quantized at load (one scale per output channel) from a full-precision checkpoint, or read from
a published fp8 checkpoint (quant_method "fp8", or "compressed-tensors" with float weights;
engine.quantization.fp8_checkpoint). Each device runs the kernel a measurement at load found
faster (engine.quantization.fp8_matmul): w8a8-fp8 through torch._scaled_mm (activations scaled
into fp8 per token, or by the checkpoint's static scale), or weight-only upcast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Self

import torch

from engine.quantization.base import WeightSource
from engine.quantization.fp8_checkpoint import Fp8Checkpoint
from engine.quantization.fp8_matmul import Fp8Kernel, fp8_kernel
from engine.quantization.weight_linear import QuantizedWeightLinear
from engine.quantization.weights import quantize_fp8

if TYPE_CHECKING:
    from engine.layers.linear import Linear
    from kernels.cpu_ops import NativeLinear


class Fp8Linear(QuantizedWeightLinear):
    source = WeightSource.QUANTIZE_AT_LOAD
    reads_checkpoints = True  # a checkpoint whose config names quant_method "fp8" is read
    activation_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None

    @classmethod
    def quantize(cls, name: str, weight: torch.Tensor, group_size: int) -> Self:
        fp8_kernel(weight.device, weight.dtype)  # measured at load, once per device and dtype
        return cls(quantize_fp8(weight))

    @classmethod
    def open_checkpoint(cls, model_path: Path) -> Fp8Checkpoint:
        config = json.loads((model_path / "config.json").read_text())
        return Fp8Checkpoint(model_path, config["quantization_config"])

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if _reads_plain_weight(layer, x.device, x.dtype):
            return layer.plain(x, layer.plan.plain())
        return super().apply(layer, x)

    def native_spec(self, layer: Linear, rows: int) -> NativeLinear | None:
        if _reads_plain_weight(layer, layer.weight.device, layer.weight.dtype):
            return layer.plain_native_spec(layer.plan.plain(), rows)
        return super().native_spec(layer, rows)

    def weight_native_spec(self, layer: Linear) -> NativeLinear | None:
        return None  # no C++ kernel multiplies fp8: the Python forward runs


def _reads_plain_weight(layer: Linear, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a layer that keeps its full-precision weight anyway (an lm_head tied to the
    embedding) computes every call from it: where the measured kernel is the weight-only upcast,
    upcasting the fp8 copy only adds work to reading a weight already in memory."""
    kept = layer.weight.device.type != "meta"
    return kept and fp8_kernel(device, dtype) is Fp8Kernel.UPCAST


class CompressedTensorsLinear(Fp8Linear):
    """An llm-compressor checkpoint of float8 weights (quant_method "compressed-tensors")."""

    source = WeightSource.QUANTIZED_CHECKPOINT
