"""Qwen3: the Llama blocks with QK-norm, an RMSNorm over each head of q and of k before rotary
(q_norm / k_norm, weights of head_dim); head_dim comes from the config, not hidden / heads."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from engine.models.blocks import LlamaShape
from engine.models.decoder import BlockVariant, QKNorm, VariantForCausalLM, read_decoder_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3ForCausalLM(VariantForCausalLM):
    @classmethod
    def read_variant(cls, hf_config: PretrainedConfig) -> tuple[LlamaShape, BlockVariant]:
        shape, variant = read_decoder_config(hf_config, cls.handled_fields)
        return shape, replace(variant, qk_norm=QKNorm.PER_HEAD)
