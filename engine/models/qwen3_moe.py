"""Qwen3-MoE: Qwen3's attention (per-head QK-norm, no biases) with Qwen2-MoE's routing (softmax,
top-k, renormalized where norm_topk_prob says so) and no shared expert; mlp_only_layers and
decoder_sparse_step pick the dense layers, as in Qwen2-MoE."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from engine.distributed.group import TensorParallel
from engine.layers.moe import SparseMoeBlock
from engine.models.decoder import GatedMLP
from engine.models.interface import WeightMapping
from engine.models.llama import LlamaForCausalLM, LlamaShape, MlpFactory
from engine.models.qwen2_moe import QWEN_EXPERTS, is_sparse_layer, qwen_router
from engine.models.qwen3 import Qwen3ForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    weight_mapping = WeightMapping(
        packed=LlamaForCausalLM.weight_mapping.packed,
        ignored_suffixes=LlamaForCausalLM.weight_mapping.ignored_suffixes,
        experts=QWEN_EXPERTS,
    )

    @classmethod
    def layer_mlps(
        cls, hf_config: PretrainedConfig, shape: LlamaShape, tp: TensorParallel | None
    ) -> MlpFactory:
        hidden = shape.dims.hidden_size
        router = qwen_router(hf_config)

        def mlp(layer: int) -> nn.Module:
            if not is_sparse_layer(hf_config, layer):
                return GatedMLP(hidden, hf_config.intermediate_size, False, "silu", tp)
            return SparseMoeBlock(hidden, hf_config.moe_intermediate_size, router, tp)

        return mlp
