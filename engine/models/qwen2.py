"""Qwen2: the Llama blocks with biases on the q/k/v projections (and on no other linear)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from engine.models.config_checks import refuse_unsupported
from engine.models.llama import LlamaForCausalLM, LlamaShape, read_llama_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def read_config(cls, hf_config: PretrainedConfig) -> LlamaShape:
        refuse_unsupported(hf_config)
        # Qwen2 configs carry no attention_bias/mlp_bias fields: the biases are the family's.
        return replace(read_llama_config(hf_config), qkv_bias=True, o_bias=False, mlp_bias=False)
