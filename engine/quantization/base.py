"""What a linear layer's weight scheme is: a `LinearMethod`, one class per quantization scheme.

A `Linear` holds one method object and defers to it for its matmul (`apply`) and for how the C++
decode stack runs it (`native_spec`). Full precision is a method too (engine.quantization.
full_precision). A quantization scheme is a `QuantizedLinearMethod` subclass: its class says how
the scheme's weights come to be (quantized at load from a full-precision checkpoint, or read from
a quantized checkpoint) and what it runs on; an instance is one layer's weight in that form.
Schemes are found by name in engine.quantization.registry.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from engine.quantization.errors import QuantizationError

if TYPE_CHECKING:
    from engine.layers.linear import Linear
    from engine.models.checkpoint import QuantizedCheckpoint
    from engine.quantization.weights import QuantizedWeight
    from kernels.cpu_ops import NativeLinear

# The quantized matmuls compute in the activations' dtype, float32 or bfloat16.
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


class LinearMethod(ABC):
    """How one linear layer stores its weight and multiplies by it."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] @ W.T + layer.bias, in x's dtype."""

    @abstractmethod
    def native_spec(self, layer: Linear, rows: int) -> NativeLinear | None:
        """How the C++ decode stack computes `apply` for calls of `rows` rows, exactly as apply
        would on the CPU; None where it cannot (the Python forward then runs)."""

    @abstractmethod
    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors this method holds besides the layer's parameters (what weight bytes
        count)."""


class WeightSource(enum.Enum):
    """Where a quantization scheme's weights come from."""

    # Quantized from a full-precision checkpoint (or random dummy weights) as it loads.
    QUANTIZE_AT_LOAD = "quantize_at_load"
    # A quantized file of its own beside the full-precision checkpoint (a GGUF file).
    OWN_FILE = "own_file"
    # The checkpoint itself, whose config.json `quantization_config` names the scheme.
    QUANTIZED_CHECKPOINT = "quantized_checkpoint"


class QuantizedLinearMethod(LinearMethod):
    """One quantization scheme. Subclasses set the class attributes and implement `quantize`
    (QUANTIZE_AT_LOAD) or `open_checkpoint` and `from_checkpoint` (the other sources)."""

    source: ClassVar[WeightSource]
    # A QUANTIZE_AT_LOAD scheme that also reads checkpoints whose config names it (fp8).
    reads_checkpoints: ClassVar[bool] = False
    runs_on_cpu: ClassVar[bool] = True
    # The activation dtypes it computes in; None: any.
    activation_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = ACTIVATION_DTYPES

    @property
    @abstractmethod
    def shape(self) -> tuple[int, int]:
        """The weight's (out_features, in_features)."""

    @abstractmethod
    def to(self, device: torch.device) -> QuantizedLinearMethod:
        """This layer's weight on `device`."""

    @classmethod
    def check_input_sizes(cls, input_sizes: list[int], group_size: int) -> None:
        """Raise QuantizationError where the model's linear input sizes do not suit the scheme
        with `quantization_group_size` (checked before any layer is quantized)."""

    @classmethod
    def quantize(cls, name: str, weight: torch.Tensor, group_size: int) -> QuantizedLinearMethod:
        """The layer `name`'s full-precision weight [out, in] in this scheme (a scheme may give
        some layers, such as the lm_head, another method)."""
        raise QuantizationError(f"{cls.__name__} reads quantized checkpoints; it does not quantize")

    @classmethod
    def reads_checkpoint_of(cls, stored: str | None) -> bool:
        """Whether the model loads from the checkpoint's own quantized tensors, for a checkpoint
        whose config names `stored` (None: not quantized)."""
        return cls.source is not WeightSource.QUANTIZE_AT_LOAD or (
            cls.reads_checkpoints and stored is not None
        )

    @classmethod
    def open_checkpoint(cls, model_path: Path) -> QuantizedCheckpoint:
        """The model folder's checkpoint in this scheme's format."""
        raise QuantizationError(f"{cls.__name__} has no checkpoint of its own to read")

    @classmethod
    def from_checkpoint(cls, weight: QuantizedWeight) -> QuantizedLinearMethod:
        """The method of a layer whose weight the checkpoint stores as `weight`."""
        raise QuantizationError(f"{cls.__name__} has no checkpoint of its own to read")
