"""Where each tensor of a GGUF file lies, from its header, without parsing the vocabulary.

gguf's own `GGUFReader` turns every metadata array element into numpy views; for a model whose
header carries a 49k-token vocabulary and its merges that takes seconds per open. The loader
needs only a few scalars and the tensor table, so arrays are skipped by their lengths here.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from engine.quantization.errors import QuantizationFormatError

_V = gguf.GGUFValueType
_SCALAR_FORMATS = {
    _V.UINT8: "<B", _V.INT8: "<b", _V.UINT16: "<H", _V.INT16: "<h", _V.UINT32: "<I",
    _V.INT32: "<i", _V.FLOAT32: "<f", _V.BOOL: "<?", _V.UINT64: "<Q", _V.INT64: "<q",
    _V.FLOAT64: "<d",
}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_shape: tuple[int, ...]  # innermost dimension first, as GGML lists them
    kind: gguf.GGMLQuantizationType
    start: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFLayout:
    metadata: dict[str, str | int | float | bool]  # scalars only; arrays are skipped
    tensors: list[GGUFTensorInfo]


class _Cursor:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.at = 0

    def unpack(self, fmt: str) -> int | float | bool:
        (value,) = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return value  # type: ignore[no-any-return]

    def integer(self, fmt: str) -> int:
        return int(self.unpack(fmt))

    def string(self) -> str:
        length = self.integer("<Q")
        text = self.buffer[self.at : self.at + length].decode("utf-8", errors="replace")
        self.at += length
        return text

    def skip_string(self) -> None:
        length = self.integer("<Q")  # read first: `self.at += ...` would load `at` before
        self.at += length

    def value(self, kind: _V) -> str | int | float | bool | None:
        """A scalar's value; arrays are stepped over and give None."""
        if kind == _V.STRING:
            return self.string()
        if kind != _V.ARRAY:
            return self.unpack(_SCALAR_FORMATS[kind])
        item_kind = _V(self.integer("<I"))
        count = self.integer("<Q")
        if item_kind == _V.STRING:
            for _ in range(count):
                self.skip_string()
        elif item_kind == _V.ARRAY:
            for _ in range(count):
                self.value(_V.ARRAY)
        else:
            self.at += count * struct.calcsize(_SCALAR_FORMATS[item_kind])
        return None


def read_gguf_layout(path: Path) -> GGUFLayout:
    """The scalar metadata and the tensor table of a GGUF file (versions 2 and 3)."""
    try:
        return _read_layout(path)
    except (struct.error, ValueError) as exc:  # ran past the end, or an unknown type code
        if isinstance(exc, QuantizationFormatError):
            raise
        raise QuantizationFormatError(f"{path} is not a readable GGUF file: {exc}") from exc


def _read_layout(path: Path) -> GGUFLayout:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        cursor = _Cursor(buffer)
        if cursor.unpack("<I") != gguf.GGUF_MAGIC:
            raise QuantizationFormatError(f"{path} is not a GGUF file (bad magic)")
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise QuantizationFormatError(f"{path}: GGUF version {version} is not supported")
        tensor_count = cursor.integer("<Q")
        field_count = cursor.integer("<Q")
        metadata: dict[str, str | int | float | bool] = {}
        for _ in range(field_count):
            key = cursor.string()
            value = cursor.value(_V(cursor.integer("<I")))
            if value is not None:
                metadata[key] = value
        table = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = tuple(cursor.integer("<Q") for _ in range(cursor.integer("<I")))
            kind = gguf.GGMLQuantizationType(cursor.integer("<I"))
            table.append((name, dims, kind, cursor.integer("<Q")))
        alignment = int(metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        data_start = -(-cursor.at // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in table:
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(dims)) // block_size * block_bytes
        tensors.append(GGUFTensorInfo(name, dims, kind, data_start + offset, nbytes))
    return GGUFLayout(metadata, tensors)
