"""Qwen2-MoE: Qwen2's attention (q/k/v biases) with a mixture of experts plus a shared expert.

Layer i's MLP is sparse unless it is listed in mlp_only_layers or (i + 1) is not a multiple of
decoder_sparse_step; a sparse one routes by softmax then top-k (renormalized where
norm_topk_prob says so) and adds the shared expert scaled by sigmoid(shared_expert_gate(x)).
The dense ones are Llama MLPs of intermediate_size.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from torch import nn

from engine.distributed.group import TensorParallel
from engine.layers.moe import RouterSpec, Scoring, SparseMoeBlock
from engine.layers.moe.layer import W2, W13
from engine.models.config_checks import UnsupportedConfigError, hidden_activation
from engine.models.decoder import LLAMA_WEIGHTS
from engine.models.llama import (
    LlamaForCausalLM,
    LlamaMLP,
    LlamaShape,
    MlpFactory,
    read_llama_config,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

QWEN_EXPERTS = {"gate_proj": (W13, 0), "up_proj": (W13, 1), "down_proj": (W2, None)}
QWEN_MOE_WEIGHTS = replace(LLAMA_WEIGHTS, experts=QWEN_EXPERTS)


def check_expert_activation(hf_config: PretrainedConfig) -> None:
    """The experts compute silu(gate) * up: refuse a config whose experts would not."""
    activation = hidden_activation(hf_config)
    if activation not in ("silu", "swish"):
        raise UnsupportedConfigError(
            f"hidden_act={activation!r} is not supported for mixture-of-experts models "
            "(supported: silu)"
        )


def is_sparse_layer(hf_config: PretrainedConfig, layer: int) -> bool:
    return (
        layer not in (getattr(hf_config, "mlp_only_layers", None) or [])
        and hf_config.num_experts > 0
        and (layer + 1) % getattr(hf_config, "decoder_sparse_step", 1) == 0
    )


def qwen_router(hf_config: PretrainedConfig) -> RouterSpec:
    check_expert_activation(hf_config)
    return RouterSpec(
        hf_config.num_experts,
        hf_config.num_experts_per_tok,
        Scoring.SOFTMAX_TOPK,
        renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
    )


def qwen_moe_mlps(
    hf_config: PretrainedConfig, shape: LlamaShape, tp: TensorParallel | None
) -> MlpFactory:
    """Each layer's MLP in the Qwen MoE families: a sparse block (with the shared expert where
    shared_expert_intermediate_size configures one) or a dense gated MLP."""
    hidden = shape.dims.hidden_size
    router = qwen_router(hf_config)
    shared_size = getattr(hf_config, "shared_expert_intermediate_size", 0)

    def mlp(layer: int) -> nn.Module:
        if not is_sparse_layer(hf_config, layer):
            return LlamaMLP(hidden, hf_config.intermediate_size, False, tp)
        shared = LlamaMLP(hidden, shared_size, False, tp) if shared_size else None
        return SparseMoeBlock(hidden, hf_config.moe_intermediate_size, router, tp, shared)

    return mlp


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    weight_mapping = QWEN_MOE_WEIGHTS

    @classmethod
    def read_config(cls, hf_config: PretrainedConfig) -> LlamaShape:
        qkv_bias = bool(getattr(hf_config, "qkv_bias", True))
        return replace(
            read_llama_config(hf_config), qkv_bias=qkv_bias, o_bias=False, mlp_bias=False
        )

    @classmethod
    def layer_mlps(
        cls, hf_config: PretrainedConfig, shape: LlamaShape, tp: TensorParallel | None
    ) -> MlpFactory:
        return qwen_moe_mlps(hf_config, shape, tp)
