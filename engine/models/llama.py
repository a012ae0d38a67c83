"""The Llama family (Llama 2/3/3.1, SmolLM2, Mistral): the configurable decoder with every
variation off. Its blocks (engine.models.blocks) are what the other families are built of."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.models.blocks import (
    LlamaAttention,
    LlamaMLP,
    LlamaShape,
    MlpFactory,
    read_llama_config,
)
from engine.models.config_checks import refuse_unsupported
from engine.models.decoder import LLAMA_WEIGHTS, BlockVariant, VariantForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "LlamaAttention",
    "LlamaForCausalLM",
    "LlamaMLP",
    "LlamaShape",
    "MlpFactory",
    "read_llama_config",
]


class LlamaForCausalLM(VariantForCausalLM):
    """Families that are Llama with other config fields (engine.models.qwen2) or other MLPs
    (the mixture-of-experts ones) override `read_config` or `layer_mlps`."""

    weight_mapping = LLAMA_WEIGHTS

    @classmethod
    def read_variant(cls, hf_config: PretrainedConfig) -> tuple[LlamaShape, BlockVariant]:
        return cls.read_config(hf_config), BlockVariant()

    @classmethod
    def read_config(cls, hf_config: PretrainedConfig) -> LlamaShape:
        refuse_unsupported(hf_config)
        return read_llama_config(hf_config)
