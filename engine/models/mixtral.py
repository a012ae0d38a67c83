"""Mixtral: the Llama blocks (Mistral's attention) with a sparse mixture of experts as every
layer's MLP: top-k of the router's logits, softmax over those k.

The checkpoint names the MoE block `block_sparse_moe` and each expert's projections w1 (gate),
w3 (up), w2 (down); the loader stacks them into the block's experts.w13 / experts.w2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.distributed.group import TensorParallel
from engine.layers.moe import RouterSpec, Scoring, SparseMoeBlock
from engine.layers.moe.layer import W2, W13
from engine.models.interface import WeightMapping
from engine.models.llama import LlamaForCausalLM, LlamaShape, MlpFactory
from engine.models.qwen2_moe import check_expert_activation

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MixtralForCausalLM(LlamaForCausalLM):
    weight_mapping = WeightMapping(
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
        ignored_suffixes=("rotary_emb.inv_freq",),
        renamed={"block_sparse_moe": "mlp"},
        experts={"w1": (W13, 0), "w3": (W13, 1), "w2": (W2, None)},
    )

    @classmethod
    def layer_mlps(
        cls, hf_config: PretrainedConfig, shape: LlamaShape, tp: TensorParallel | None
    ) -> MlpFactory:
        check_expert_activation(hf_config)
        router = RouterSpec(
            hf_config.num_local_experts, hf_config.num_experts_per_tok, Scoring.TOPK_SOFTMAX
        )
        hidden, intermediate = shape.dims.hidden_size, hf_config.intermediate_size
        return lambda _: SparseMoeBlock(hidden, intermediate, router, tp)
