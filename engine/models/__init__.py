"""Model registry: which module implements an HF config's architecture."""

from __future__ import annotations

import functools
from typing import Any, Protocol

from torch import nn

from engine.attention.base import AttentionBackend
from engine.distributed.group import TensorParallel
from engine.models.llama import LlamaForCausalLM


class ModelFactory(Protocol):
    def __call__(
        self, hf_config: Any, backend: AttentionBackend, *, tp: TensorParallel | None = None
    ) -> nn.Module: ...


# HF architecture name -> factory(hf_config, backend, tp=...)
_ARCHITECTURES: dict[str, ModelFactory] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": functools.partial(LlamaForCausalLM, qkv_bias=True),
}
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_factory(hf_config: Any) -> ModelFactory:
    """The factory for an HF config, by its `architectures`, else its `model_type`."""
    for arch in getattr(hf_config, "architectures", None) or ():
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    arch = _MODEL_TYPES.get(getattr(hf_config, "model_type", ""))
    if arch is None:
        raise NotImplementedError(
            f"unsupported model (architectures={getattr(hf_config, 'architectures', None)}, "
            f"model_type={getattr(hf_config, 'model_type', None)!r}); "
            f"supported: {', '.join(supported_architectures())}"
        )
    return _ARCHITECTURES[arch]


def sliding_window_limit(hf_config: Any) -> int | None:
    """Context length up to which full attention equals the model's sliding-window attention.

    We implement full attention only, so a model that really uses a window is exact only up to
    that many tokens (e.g. Mistral 7B v0.1: 4096); None when no window applies.
    """
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    return int(window)
