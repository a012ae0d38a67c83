"""gpt-oss: pre-norm decoder layers whose attention adds a learned sink logit per head to each
softmax denominator, alternating sliding-window and full layers (layer_types), q/k/v/o biases,
yarn rope, and a mixture of experts in every layer (engine.layers.moe.biased: router and
experts with biases, the clamped SwiGLU of swiglu_alpha and swiglu_limit).

Checkpoints store the experts stacked (mlp.experts.gate_up_proj and down_proj with their
biases), which is the layout the experts keep. MXFP4-quantized releases name their scheme in
quantization_config, which the engine refuses unless it implements it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from engine.distributed.group import TensorParallel
from engine.layers.moe import BiasedMoeBlock, RouterSpec, Scoring
from engine.models.blocks import LlamaShape, MlpFactory
from engine.models.decoder import BlockVariant, VariantForCausalLM, read_decoder_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class GptOssForCausalLM(VariantForCausalLM):
    @classmethod
    def read_variant(cls, hf_config: PretrainedConfig) -> tuple[LlamaShape, BlockVariant]:
        shape, variant = read_decoder_config(hf_config, cls.handled_fields)
        return shape, replace(variant, attention_sinks=True)

    @classmethod
    def layer_mlps(
        cls, hf_config: PretrainedConfig, shape: LlamaShape, tp: TensorParallel | None
    ) -> MlpFactory:
        if tp is not None:
            raise NotImplementedError("gpt-oss does not run under tensor parallelism yet")
        router = RouterSpec(
            hf_config.num_local_experts, hf_config.num_experts_per_tok, Scoring.TOPK_SOFTMAX
        )
        hidden, intermediate = shape.dims.hidden_size, hf_config.intermediate_size
        alpha, limit = float(hf_config.swiglu_alpha), float(hf_config.swiglu_limit)
        return lambda _: BiasedMoeBlock(hidden, intermediate, router, alpha, limit)
