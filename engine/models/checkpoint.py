"""Checkpoint readers: the tensors of an HF safetensors folder, or of an in-memory dict."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from engine.quantization.weights import QuantizedWeight

if TYPE_CHECKING:
    from engine.layers.parallel import TensorSlice

_SAFETENSORS_INDEX = "model.safetensors.index.json"


class WeightLoadError(ValueError):
    """The checkpoint does not match the model built from its config."""


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class _TensorEntry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


class SafetensorsCheckpoint:
    """The tensors of an HF folder's safetensors files (sharded or not), read on demand.

    Tensors are read with plain file reads straight into their destination when dtype and
    device allow: on a VM, faulting in an mmap of the file first costs more than the copy.
    """

    def __init__(self, model_path: Path) -> None:
        index = model_path / _SAFETENSORS_INDEX
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({model_path / name for name in weight_map.values()})
        else:
            files = sorted(model_path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_path}")
        self.entries: dict[str, _TensorEntry] = {}
        for file in files:
            self.entries.update(_read_header(file))

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def read_into(self, name: str, destination: torch.Tensor) -> None:
        entry = self.entries[name]
        direct = (
            destination.device.type == "cpu"
            and destination.dtype == entry.dtype
            and destination.is_contiguous()
            and destination.numel() > 0
        )
        with open(entry.file, "rb") as f:
            f.seek(entry.start)
            if direct:
                buffer = destination.view(-1).view(torch.uint8).numpy()
                if f.readinto(memoryview(buffer)) != entry.end - entry.start:
                    raise WeightLoadError(f"{entry.file} is truncated at tensor {name}")
                return
            raw = bytearray(f.read(entry.end - entry.start))
        source = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        destination.copy_(source.view(entry.dtype).view(entry.shape))

    def read_slice_into(self, name: str, destination: torch.Tensor, piece: TensorSlice) -> None:
        """Read only indices piece.start:+piece.length along piece.dim (one tensor-parallel
        rank's shard): the file is memory-mapped and only the slice's pages are touched."""
        from safetensors import safe_open

        entry = self.entries[name]
        index = tuple(
            slice(piece.start, piece.start + piece.length) if dim == piece.dim else slice(None)
            for dim in range(len(entry.shape))
        )
        with safe_open(str(entry.file), framework="pt") as f:
            destination.copy_(f.get_slice(name)[index])


def _read_header(file: Path) -> dict[str, _TensorEntry]:
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data_start = 8 + header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise WeightLoadError(f"{file}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        entries[name] = _TensorEntry(
            file, dtype, tuple(info["shape"]), data_start + begin, data_start + end
        )
    return entries


class TensorDictCheckpoint:
    """In-memory tensors by name, read like a checkpoint (tests, conversions)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read_into(self, name: str, destination: torch.Tensor) -> None:
        destination.copy_(self.tensors[name])

    def read_slice_into(self, name: str, destination: torch.Tensor, piece: TensorSlice) -> None:
        destination.copy_(self.tensors[name].narrow(piece.dim, piece.start, piece.length))


@runtime_checkable
class QuantizedCheckpoint(Protocol):
    """A checkpoint some of whose tensors are quantized (GGUF blocks, GPTQ, AWQ): those are
    read whole as `QuantizedWeight`s, the rest like any checkpoint's."""

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read_into(self, name: str, destination: torch.Tensor) -> None: ...

    def quantized_names(self) -> set[str]: ...

    def read_quantized(self, name: str) -> QuantizedWeight: ...


Checkpoint = SafetensorsCheckpoint | TensorDictCheckpoint | QuantizedCheckpoint
