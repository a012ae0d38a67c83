"""Gemma 2: local sliding-window layers alternating with global ones, soft-capped scores.

The Gemma blocks of engine.models.gemma3 without QK-norm: scaled embeddings, (1 + weight)
RMSNorms, sandwich norms, gelu-tanh MLP, a query_pre_attn_scalar scale; one rope table for
every layer; attention scores soft-capped by attn_logit_softcapping (in every attention path)
and the final logits by final_logit_softcapping.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from engine.layers.rotary import rope_parameters
from engine.models.gemma3 import FULL, SLIDING, Gemma3ForCausalLM, GemmaShape, read_gemma3_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def read_gemma2_config(hf_config: PretrainedConfig) -> GemmaShape:
    shape = read_gemma3_config(hf_config)
    rope = rope_parameters(hf_config)
    return replace(shape, qk_norm=False, rope={FULL: rope, SLIDING: rope})


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    @classmethod
    def read_config(cls, hf_config: PretrainedConfig) -> GemmaShape:
        return read_gemma2_config(hf_config)
