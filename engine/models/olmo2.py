"""OLMo 2: norms after attention and after the MLP (each sublayer's output is normalized before
it joins the residual stream; nothing normalizes a sublayer's input), and QK-norm over the whole
q and k projections (weights of heads * head_dim), before rotary."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from engine.models.blocks import LlamaShape
from engine.models.decoder import BlockVariant, QKNorm, VariantForCausalLM, read_decoder_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Olmo2ForCausalLM(VariantForCausalLM):
    @classmethod
    def read_variant(cls, hf_config: PretrainedConfig) -> tuple[LlamaShape, BlockVariant]:
        shape, variant = read_decoder_config(hf_config, cls.handled_fields)
        return shape, replace(variant, qk_norm=QKNorm.WHOLE, pre_norms=False, post_norms=True)
