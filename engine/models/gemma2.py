"""Gemma 2: local sliding-window layers alternating with global ones, soft-capped scores.

Gemma's blocks (engine.models.gemma3.gemma_variant) without QK-norm, one rope table for every
layer, and attention scores soft-capped by attn_logit_softcapping in every attention path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.models.blocks import LlamaShape
from engine.models.decoder import BlockVariant, VariantForCausalLM, read_decoder_config
from engine.models.gemma3 import GEMMA_FIELDS, gemma_variant

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Gemma2ForCausalLM(VariantForCausalLM):
    handled_fields = GEMMA_FIELDS

    @classmethod
    def read_variant(cls, hf_config: PretrainedConfig) -> tuple[LlamaShape, BlockVariant]:
        shape, variant = read_decoder_config(hf_config, cls.handled_fields)
        return shape, gemma_variant(hf_config, variant)
