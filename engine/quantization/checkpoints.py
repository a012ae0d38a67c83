"""Open a pre-quantized checkpoint (GGUF, GPTQ, AWQ) of a model folder for the loader."""

from __future__ import annotations

from pathlib import Path

from engine.models.checkpoint import QuantizedCheckpoint
from engine.quantization.methods import QuantizationError, QuantizationMethod


def open_quantized_checkpoint(method: QuantizationMethod, model_path: Path) -> QuantizedCheckpoint:
    raise QuantizationError(f"quantization={method!r}: checkpoint reader not merged yet")
