"""Gemma 3 (text): local sliding-window layers between global ones, each kind with its own rope.

The configurable decoder with Gemma's blocks (`gemma_variant`, shared with Gemma 2): the
embedding scaled by sqrt(hidden_size) (rounded to the weights' dtype, as the reference does),
every RMSNorm multiplying by (1 + weight), each sublayer's input and output normed (sandwich
norms), a gelu-tanh gated MLP (read from the config like any family's activation), attention
scaled by query_pre_attn_scalar ** -0.5 and the final logits soft-capped where configured.
Gemma 3 adds per-head QK-norm and gives its local layers their own rope base (the config's
rope parameters per layer kind); layers are local or global by the config's layer_types.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from engine.layers.rotary import sliding_rope_parameters
from engine.models.blocks import LlamaShape
from engine.models.decoder import BlockVariant, QKNorm, VariantForCausalLM, read_decoder_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GEMMA_FIELDS = frozenset(
    {"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"}
)


def gemma_variant(hf_config: PretrainedConfig, variant: BlockVariant) -> BlockVariant:
    """The generic variant with the blocks Gemma 2 and Gemma 3 share."""
    attention_cap = getattr(hf_config, "attn_logit_softcapping", None)
    logits_cap = getattr(hf_config, "final_logit_softcapping", None)
    return replace(
        variant,
        post_norms=True,
        offset_norms=True,
        embedding_multiplier=float(hf_config.hidden_size) ** 0.5,
        embedding_multiplier_in_dtype=True,
        attention_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
        attention_softcap=float(attention_cap) if attention_cap else None,
        logits_softcap=float(logits_cap) if logits_cap else None,
    )


class Gemma3ForCausalLM(VariantForCausalLM):
    handled_fields = GEMMA_FIELDS

    @classmethod
    def read_variant(cls, hf_config: PretrainedConfig) -> tuple[LlamaShape, BlockVariant]:
        shape, variant = read_decoder_config(hf_config, cls.handled_fields)
        return shape, replace(
            gemma_variant(hf_config, variant),
            qk_norm=QKNorm.PER_HEAD,
            sliding_rope=sliding_rope_parameters(hf_config),
        )
