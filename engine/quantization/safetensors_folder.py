"""The part every pre-quantized safetensors checkpoint reader shares (GPTQ, AWQ, fp8): which
file holds each tensor, reading one, and serving a quantized linear dequantized where the
loader asks for plain values."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from safetensors import safe_open

from engine.quantization.weights import QuantizedWeight, dequantize

_SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's safetensors files (those its index names, where it has one)."""
    index = folder / _SAFETENSORS_INDEX
    if index.exists():
        return sorted(
            {folder / file for file in json.loads(index.read_text())["weight_map"].values()}
        )
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


class QuantizedSafetensorsFolder(ABC):
    """A safetensors folder some of whose linears are stored quantized: each appears as
    `<prefix>.weight`, for the prefixes in `_prefixes` a subclass sets."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._files: dict[str, Path] = {}
        for file in safetensors_files(folder):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    self._files[name] = file
        self._prefixes: set[str] = set()

    def quantized_names(self) -> set[str]:
        return {f"{prefix}.weight" for prefix in self._prefixes}

    @abstractmethod
    def read_quantized(self, name: str) -> QuantizedWeight:
        """The quantized linear `name` (`<prefix>.weight`) in the in-memory form."""

    def read_into(self, name: str, destination: torch.Tensor) -> None:
        """Copy a tensor into destination; a quantized linear arrives dequantized."""
        if name in self.quantized_names():
            destination.copy_(dequantize(self.read_quantized(name)))
        else:
            destination.copy_(self._tensor(name))

    def _tensor(self, name: str) -> torch.Tensor:
        with safe_open(str(self._files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def _slice_shape(self, name: str) -> list[int]:
        with safe_open(str(self._files[name]), framework="pt") as f:
            return list(f.get_slice(name).get_shape())
