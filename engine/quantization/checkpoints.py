"""Open a pre-quantized checkpoint (GGUF, GPTQ, AWQ) of a model folder for the loader."""

from __future__ import annotations

import json
from pathlib import Path

from engine.models.checkpoint import QuantizedCheckpoint
from engine.quantization.errors import QuantizationError
from engine.quantization.gguf import GGUFCheckpoint, find_gguf_file
from engine.quantization.methods import QuantizationMethod
from engine.quantization.packed_int import PackedIntCheckpoint


def open_quantized_checkpoint(method: QuantizationMethod, model_path: Path) -> QuantizedCheckpoint:
    """The folder's checkpoint in `method`'s format (resolve_method has checked the pairing)."""
    if method == "gguf":
        gguf_file = find_gguf_file(model_path)
        if gguf_file is None:
            raise QuantizationError(
                f"quantization='gguf' needs a .gguf file in the model folder; {model_path} has "
                "none (registry models keep theirs: run `inferq model pull` again)"
            )
        return GGUFCheckpoint(gguf_file)
    if method in ("gptq", "awq"):
        config = json.loads((model_path / "config.json").read_text())
        return PackedIntCheckpoint(model_path, config["quantization_config"])
    raise QuantizationError(f"quantization={method!r} has no checkpoint of its own to read")
