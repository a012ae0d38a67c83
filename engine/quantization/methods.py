"""Which quantization a model loads with, checked at start-up, and quantizing at load.

A method is chosen once, before any weight is read: the `quantization` engine argument, or
what the checkpoint's own config names. Every mismatch (an unknown value, a flag the checkpoint
contradicts, a device or dtype no kernel of the method serves) is a `QuantizationError` whose
message names the value and what is supported; nothing falls back to full precision silently.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear, shared_parameter_ids
from engine.layers.moe import BiasedExperts, FusedExperts
from engine.quantization.base import QuantizedLinearMethod, WeightSource
from engine.quantization.errors import QuantizationError
from engine.quantization.fp8 import Fp8Linear
from engine.quantization.int4 import Int4Linear
from engine.quantization.int8 import Int8Linear
from engine.quantization.registry import QUANTIZATION_SCHEMES, method_class
from engine.quantization.weight_linear import QuantizedWeightLinear
from engine.quantization.weights import QuantizedWeight

logger = logging.getLogger(__name__)


def checkpoint_method(model_path: Path | None) -> str | None:
    """The `quant_method` of the folder's config.json `quantization_config`, if any."""
    if model_path is None or not (model_path / "config.json").exists():
        return None
    config = json.loads((model_path / "config.json").read_text())
    method = (config.get("quantization_config") or {}).get("quant_method")
    return str(method).lower() if method else None


def _schemes_where(keep: Callable[[type[QuantizedLinearMethod]], bool]) -> str:
    return ", ".join(name for name in QUANTIZATION_SCHEMES if keep(method_class(name)))


def resolve_method(
    requested: str | None,
    model_path: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str,
) -> str | None:
    """The scheme the model loads with, or None for full precision; raise QuantizationError."""
    stored = checkpoint_method(model_path) if load_format != "dummy" else None
    if requested is None:
        if stored is None:
            return None
        if stored not in QUANTIZATION_SCHEMES or not method_class(stored).reads_checkpoint_of(
            stored
        ):
            raise QuantizationError(
                f"{model_path} is quantized with {stored!r}, which inferq does not read; "
                "supported checkpoint formats: "
                + _schemes_where(lambda m: m.reads_checkpoint_of("any"))
            )
        logger.info("checkpoint %s is %s-quantized: loading it as such", model_path, stored)
        requested = stored
    method = method_class(requested)  # QuantizationError for an unknown name
    if method.source is WeightSource.QUANTIZED_CHECKPOINT and stored != requested:
        raise QuantizationError(
            f"quantization={requested!r} needs a {requested} checkpoint, but {model_path}/"
            f"config.json names {f'quant_method {stored!r}' if stored else 'no quantization'}"
        )
    if (
        method.source is not WeightSource.QUANTIZED_CHECKPOINT
        and stored is not None
        and not (method.reads_checkpoints and stored == requested)
    ):
        raise QuantizationError(
            f"quantization={requested!r} needs a full-precision checkpoint, but {model_path} is "
            f"already {stored}-quantized; use quantization={stored!r}"
        )
    if load_format == "dummy" and method.source is not WeightSource.QUANTIZE_AT_LOAD:
        raise QuantizationError(
            f"quantization={requested!r} needs a checkpoint to read; with random weights "
            "(load_format='dummy') supported: "
            + _schemes_where(lambda m: m.source is WeightSource.QUANTIZE_AT_LOAD)
        )
    if device.type == "cpu" and not method.runs_on_cpu:
        raise QuantizationError(
            f"quantization={requested!r} needs a CUDA device; on the CPU: "
            + _schemes_where(lambda m: m.runs_on_cpu)
        )
    if method.activation_dtypes is not None and dtype not in method.activation_dtypes:
        raise QuantizationError(
            f"quantization={requested!r} does not run dtype {dtype}; supported: "
            + ", ".join(str(d).removeprefix("torch.") for d in method.activation_dtypes)
        )
    return requested


def quantize_at_load(
    model: nn.Module, method: type[QuantizedLinearMethod], group_size: int
) -> None:
    """Quantize every Linear of a loaded full-precision model in place with the scheme's
    `method` (which may give some layers, such as the lm_head, another one). The embedding keeps
    its precision: a lookup reads one row."""
    if any(isinstance(m, BiasedExperts) for m in model.modules()):
        raise QuantizationError(
            "gpt-oss's experts (with biases) are not quantized yet: load this model in full "
            "precision (quantization=None)"
        )
    shared = shared_parameter_ids(model)
    sizes = {m.in_features for m in model.modules() if isinstance(m, Linear)}
    experts = [(n, m) for n, m in model.named_modules() if isinstance(m, FusedExperts)]
    for _, module in experts:
        sizes |= {module.w13.shape[-1], module.w2.shape[-1]}
    method.check_input_sizes(sorted(sizes), group_size)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, Linear) or module.is_quantized:
                continue
            quantized = method.quantize(name, module.weight.detach(), group_size)
            module.use_method(quantized, keep_plain_weight=id(module.weight) in shared)
        for name, module in experts:
            quantize_experts(name, module, method, group_size)


def quantize_experts(
    name: str, experts: FusedExperts, method: type[QuantizedLinearMethod], group_size: int
) -> None:
    """Each expert's projections in the scheme (int8, int4, fp8)."""
    if not issubclass(method, (Int8Linear, Int4Linear, Fp8Linear)):
        raise QuantizationError(
            f"{method.__name__} does not quantize mixture-of-experts weights; "
            "for a MoE model use quantization='int8', 'int4' or 'fp8'"
        )

    def each(param: str, stacked: torch.Tensor) -> list[QuantizedWeight]:
        weights = []
        for expert in range(stacked.shape[0]):
            quantized = method.quantize(f"{name}.{expert}.{param}", stacked[expert], group_size)
            assert isinstance(quantized, QuantizedWeightLinear)
            weights.append(quantized.weight)
        return weights

    experts.use_quantized(each("w13", experts.w13.detach()), each("w2", experts.w2.detach()))


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take: parameters and buffers on a real device, plus what the
    layers' quantization methods hold (a quantized table shared by two modules counted once)."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        if isinstance(module, Linear):
            tensors += module.method.weight_tensors()
        elif isinstance(module, VocabEmbedding) and module.quantized is not None:
            tensors += module.quantized.tensors()
        elif isinstance(module, FusedExperts):
            tensors += module.quantized_tensors()
    total = 0
    seen: set[int] = set()
    for tensor in tensors:
        if tensor.device.type != "meta" and id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total
