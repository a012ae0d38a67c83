"""The quantization schemes by name: the one table the config, the loader and `Linear` read.

Each entry names the scheme's `QuantizedLinearMethod` class by import path, imported only when
the scheme is used, so that reading the table (the `quantization` engine argument's choices and
help) costs no torch import. A new scheme is its own file under engine/quantization/ and one
line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.quantization.errors import QuantizationError

if TYPE_CHECKING:
    from engine.quantization.base import QuantizedLinearMethod


@dataclass(frozen=True)
class Scheme:
    method: str  # "module:Class" of its QuantizedLinearMethod
    help: str  # what the engine argument's help says of it


QUANTIZATION_SCHEMES: dict[str, Scheme] = {
    "int8": Scheme(
        "engine.quantization.int8:Int8Linear",
        "per output channel, quantized at load from a full-precision checkpoint (embedding as "
        "loaded)",
    ),
    "w8a8": Scheme(
        "engine.quantization.w8a8:W8A8Linear",
        "int8 weights as int8, and calls of more than 16 rows (prefill) also quantize "
        "activations to int8 per token and multiply integers (lm_head weight-only)",
    ),
    "int4": Scheme(
        "engine.quantization.int4:Int4Linear",
        "group-wise with a minimum, quantized at load (lm_head int8, embedding as loaded)",
    ),
    "gguf": Scheme(
        "engine.quantization.gguf:GGUFLinear",
        "the model folder's GGUF file, its Q4_0/Q4_1/Q8_0 blocks used as they are",
    ),
    "gptq": Scheme("engine.quantization.packed_int:PackedIntLinear", "a GPTQ checkpoint"),
    "awq": Scheme("engine.quantization.packed_int:PackedIntLinear", "an AWQ checkpoint"),
    "fp8": Scheme(
        "engine.quantization.fp8:Fp8Linear",
        "float8_e4m3fn weights per output channel, quantized at load, or an fp8 checkpoint "
        "(weight_block_size blocks); w8a8-fp8 (torch._scaled_mm, dynamic per-token activation "
        "scales) where a load-time measurement finds it runs and is faster, else weight-only",
    ),
    "compressed-tensors": Scheme(
        "engine.quantization.fp8:CompressedTensorsLinear",
        "an llm-compressor checkpoint of float8 weights (per tensor, channel or block; static or "
        "dynamic input scales), run as fp8",
    ),
}


def scheme_help() -> str:
    """The `quantization` engine argument's help: every scheme's own line."""
    schemes = "; ".join(f"{name}: {scheme.help}" for name, scheme in QUANTIZATION_SCHEMES.items())
    default = "what the checkpoint's config names, else full precision"
    return f"weight quantization. {schemes}. Default: {default}"


def method_class(name: str) -> type[QuantizedLinearMethod]:
    """The method class of scheme `name`; QuantizationError for a name not in the table."""
    scheme = QUANTIZATION_SCHEMES.get(name)
    if scheme is None:
        raise QuantizationError(
            f"quantization={name!r} is not supported; supported: {', '.join(QUANTIZATION_SCHEMES)}"
        )
    from engine.quantization import base  # torch: only once a scheme is used

    module, _, attribute = scheme.method.partition(":")
    found = vars(importlib.import_module(module))[attribute]
    if not (isinstance(found, type) and issubclass(found, base.QuantizedLinearMethod)):
        raise TypeError(f"{scheme.method} (scheme {name!r}) is not a QuantizedLinearMethod")
    return found
