"""How a job hash stores a result's vector (an embedding, a cross-encoder's scores): float32
bytes in base64 when every value is a float32 exactly, as an engine's float32 output always is.
That is about a third of the JSON text of the same floats, and neither the worker nor the reader
formats or parses 17-digit decimals per value; a vector that float32 cannot hold exactly stays
JSON floats. Only the hash uses this form: a JobResult's `embedding` is always the floats."""

from __future__ import annotations

import base64
import binascii
import sys
from array import array

PACKED_EMBEDDING_FIELD = "embedding_f32"  # a stored result's vector, packed (little-endian)
# a multi-input job's vectors, each packed as above, in input order
PACKED_EMBEDDINGS_FIELD = "embeddings_f32"


def pack_float32(vector: list[float]) -> str | None:
    """`vector` as base64 of little-endian float32, or None when float32 would change a value."""
    packed = array("f", vector)
    if packed.tolist() != vector:  # wider than float32 (or NaN, which equals nothing)
        return None
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def unpack_float32(text: str) -> list[float] | None:
    """The floats `pack_float32` packed; None for text that is not such a packing."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(raw) % 4:
        return None
    packed = array("f")
    packed.frombytes(raw)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()
