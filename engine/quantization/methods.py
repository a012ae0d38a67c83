"""Which quantization a model loads with, checked at start-up, and quantizing at load.

A method is chosen once, before any weight is read: the `quantization` engine argument, or
what the checkpoint's own config names. Every mismatch (an unknown value, a flag the checkpoint
contradicts, a device or dtype no kernel of the method serves) is a `QuantizationError` whose
message names the value and what is supported; nothing falls back to full precision silently.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Literal, get_args

import torch
from torch import nn

from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear, shared_parameter_ids
from engine.quantization.errors import QuantizationError
from engine.quantization.weights import Q4_BLOCK, quantize_fp8, quantize_int4, quantize_int8

logger = logging.getLogger(__name__)

QuantizationMethod = Literal["int8", "w8a8", "int4", "gguf", "gptq", "awq", "fp8"]
METHODS: tuple[QuantizationMethod, ...] = get_args(QuantizationMethod)
# Quantized from a full-precision checkpoint as it loads.
AT_LOAD: tuple[QuantizationMethod, ...] = ("int8", "w8a8", "int4", "fp8")
CHECKPOINT_FORMATS: tuple[QuantizationMethod, ...] = ("gptq", "awq")  # named in config.json
CPU_METHODS: tuple[QuantizationMethod, ...] = ("int8", "w8a8", "int4", "gguf", "gptq", "awq")
# The quantized matmuls compute in the activations' dtype, float32 or bfloat16.
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


def checkpoint_method(model_path: Path | None) -> str | None:
    """The `quant_method` of the folder's config.json `quantization_config`, if any."""
    if model_path is None or not (model_path / "config.json").exists():
        return None
    config = json.loads((model_path / "config.json").read_text())
    method = (config.get("quantization_config") or {}).get("quant_method")
    return str(method).lower() if method else None


def resolve_method(
    requested: str | None,
    model_path: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str,
) -> QuantizationMethod | None:
    """The method the model loads with, or None for full precision; raise QuantizationError."""
    stored = checkpoint_method(model_path) if load_format != "dummy" else None
    if requested is None:
        if stored is None:
            return None
        if stored not in CHECKPOINT_FORMATS:
            raise QuantizationError(
                f"{model_path} is quantized with {stored!r}, which inferq does not read; "
                f"supported checkpoint formats: {', '.join(CHECKPOINT_FORMATS)}"
            )
        logger.info("checkpoint %s is %s-quantized: loading it as such", model_path, stored)
        requested = stored
    if requested not in METHODS:
        raise QuantizationError(
            f"quantization={requested!r} is not supported; supported: {', '.join(METHODS)}"
        )
    method: QuantizationMethod = requested  # type: ignore[assignment]  # checked just above
    if method in CHECKPOINT_FORMATS and stored != method:
        raise QuantizationError(
            f"quantization={method!r} needs a {method} checkpoint, but {model_path}/config.json "
            f"names {f'quant_method {stored!r}' if stored else 'no quantization'}"
        )
    if method in (*AT_LOAD, "gguf") and stored is not None:
        raise QuantizationError(
            f"quantization={method!r} needs a full-precision checkpoint, but {model_path} is "
            f"already {stored}-quantized; use quantization={stored!r}"
        )
    if load_format == "dummy" and method not in AT_LOAD:
        raise QuantizationError(
            f"quantization={method!r} needs a checkpoint to read; with random weights "
            f"(load_format='dummy') supported: {', '.join(AT_LOAD)}"
        )
    if device.type == "cpu" and method not in CPU_METHODS:
        raise QuantizationError(
            f"quantization={method!r} needs a CUDA device; on the CPU: {', '.join(CPU_METHODS)}"
        )
    if method != "fp8" and dtype not in ACTIVATION_DTYPES:
        raise QuantizationError(
            f"quantization={method!r} does not run dtype {dtype}; supported: float32, bfloat16"
        )
    return method


def quantize_at_load(model: nn.Module, method: QuantizationMethod, group_size: int) -> None:
    """Quantize every Linear of a loaded full-precision model in place: the decoder's
    projections with `method`, the lm_head with int8 for int4 (4 bits there costs more quality
    than the rest of the model together) and weight-only for w8a8. The embedding keeps its
    precision: a lookup reads one row."""
    shared = shared_parameter_ids(model)
    if method == "int4":
        sizes = sorted({m.in_features for m in model.modules() if isinstance(m, Linear)})
        if group_size % Q4_BLOCK or any(size % group_size for size in sizes):
            raise QuantizationError(
                f"quantization_group_size={group_size} does not divide the input sizes of the "
                f"linear layers ({', '.join(map(str, sizes))}); supported: multiples of 32 that do"
            )
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, Linear) or module.quantized is not None:
                continue
            weight = module.weight.detach()
            if method == "fp8":
                quantized = quantize_fp8(weight)
            elif method == "int4" and name != "lm_head":
                quantized = quantize_int4(weight, group_size)
            else:
                # The lm_head keeps exact activations: integer logits cost the most quality of
                # any layer, and serving computes them for a few rows per step, not a prompt's.
                quantized = replace(
                    quantize_int8(weight), int8_activations=method == "w8a8" and name != "lm_head"
                )
            module.use_quantized(quantized, keep_plain_weight=id(module.weight) in shared)


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take: parameters and buffers on a real device, plus the
    quantized weights (a quantized table shared by two modules counted once)."""
    total = 0
    seen: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type != "meta" and id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    for module in model.modules():
        quantized = module.quantized if isinstance(module, (Linear, VocabEmbedding)) else None
        if quantized is not None and id(quantized.data) not in seen:
            seen.add(id(quantized.data))
            total += quantized.nbytes()
    return total
