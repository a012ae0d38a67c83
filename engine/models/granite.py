"""Granite (3.x dense): the Llama blocks with four multipliers: the embeddings are scaled by
embedding_multiplier, each sublayer's output by residual_multiplier before the residual add,
attention_multiplier is the softmax scale (instead of head_dim ** -0.5) and the logits are
divided by logits_scaling."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from engine.models.blocks import LlamaShape
from engine.models.decoder import BlockVariant, VariantForCausalLM, read_decoder_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_MULTIPLIERS = frozenset(
    {"embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"}
)


class GraniteForCausalLM(VariantForCausalLM):
    handled_fields = _MULTIPLIERS

    @classmethod
    def read_variant(cls, hf_config: PretrainedConfig) -> tuple[LlamaShape, BlockVariant]:
        shape, variant = read_decoder_config(hf_config, cls.handled_fields)
        return shape, replace(
            variant,
            embedding_multiplier=float(hf_config.embedding_multiplier),
            residual_multiplier=float(hf_config.residual_multiplier),
            attention_scale=float(hf_config.attention_multiplier),
            logits_divisor=float(hf_config.logits_scaling),
        )
