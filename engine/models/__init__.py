"""Model registry: which family implements an HF config's architecture.

A family is one module of this package implementing engine.models.interface.CausalLM; it is
registered by one line of `_FAMILIES` (imported on first use), or from outside the package by
`register_architecture`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend
from engine.distributed.group import TensorParallel
from engine.models.interface import CausalLM, ModelFactory

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Registration:
    architecture: str  # the HF config's `architectures` entry
    model_type: str  # the HF config's `model_type`, for configs that name no architecture
    family: str | ModelFactory  # "module:Class" under engine.models, or the class itself


_FAMILIES: dict[str, Registration] = {
    entry.architecture: entry
    for entry in (
        Registration("LlamaForCausalLM", "llama", "llama:LlamaForCausalLM"),
        Registration("MistralForCausalLM", "mistral", "llama:LlamaForCausalLM"),
        Registration("Qwen2ForCausalLM", "qwen2", "qwen2:Qwen2ForCausalLM"),
        Registration("Gemma2ForCausalLM", "gemma2", "gemma2:Gemma2ForCausalLM"),
        Registration("Gemma3ForCausalLM", "gemma3_text", "gemma3:Gemma3ForCausalLM"),
        Registration("Qwen3ForCausalLM", "qwen3", "qwen3:Qwen3ForCausalLM"),
        Registration("Olmo2ForCausalLM", "olmo2", "olmo2:Olmo2ForCausalLM"),
        Registration("GraniteForCausalLM", "granite", "granite:GraniteForCausalLM"),
        Registration("SmolLM3ForCausalLM", "smollm3", "smollm3:SmolLM3ForCausalLM"),
        Registration("Phi3ForCausalLM", "phi3", "phi3:Phi3ForCausalLM"),
        Registration("MixtralForCausalLM", "mixtral", "mixtral:MixtralForCausalLM"),
        Registration("Qwen2MoeForCausalLM", "qwen2_moe", "qwen2_moe:Qwen2MoeForCausalLM"),
        Registration("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3_moe:Qwen3MoeForCausalLM"),
        Registration("GptOssForCausalLM", "gpt_oss", "gpt_oss:GptOssForCausalLM"),
        Registration("DeepseekV2ForCausalLM", "deepseek_v2", "deepseek_v2:DeepseekV2ForCausalLM"),
        Registration("DeepseekV3ForCausalLM", "deepseek_v3", "deepseek_v3:DeepseekV3ForCausalLM"),
    )
}


def register_architecture(architecture: str, model_type: str, family: ModelFactory) -> None:
    """Serve configs naming `architecture` (or, naming none, of `model_type`) with `family`."""
    _FAMILIES[architecture] = Registration(architecture, model_type, family)


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES)


def _registration(hf_config: PretrainedConfig) -> Registration:
    named = hf_config.architectures or ()
    model_type = hf_config.model_type
    entry = next((_FAMILIES[arch] for arch in named if arch in _FAMILIES), None)
    if entry is None:
        entry = next((e for e in _FAMILIES.values() if e.model_type == model_type), None)
    if entry is None:
        raise NotImplementedError(
            f"unsupported model (architectures={list(named) or None}, "
            f"model_type={model_type!r}); supported: {', '.join(supported_architectures())}"
        )
    return entry


def served_architecture(hf_config: PretrainedConfig) -> str:
    """The architecture the engine serves hf_config as (e.g. "Qwen3ForCausalLM"): what a worker
    reports of its model."""
    return _registration(hf_config).architecture


def model_factory(hf_config: PretrainedConfig) -> ModelFactory:
    """The family for an HF config, by its `architectures`, else its `model_type`."""
    entry = _registration(hf_config)
    if not isinstance(entry.family, str):
        return entry.family
    module, name = entry.family.split(":")
    family: ModelFactory = getattr(importlib.import_module(f"engine.models.{module}"), name)
    return family


def meta_model(
    hf_config: PretrainedConfig, backend: AttentionBackend, tp: TensorParallel | None = None
) -> CausalLM:
    """The model for hf_config on the meta device: its layout and shapes, no memory, no init."""
    with torch.device("meta"):
        return model_factory(hf_config)(hf_config, backend, tp=tp)
