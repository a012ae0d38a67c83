"""Qwen3-MoE: Qwen3's attention (per-head QK-norm, no biases) with Qwen2-MoE's routing (softmax,
top-k, renormalized where norm_topk_prob says so), its shared expert only where configured; mlp_only_layers and
decoder_sparse_step pick the dense layers, as in Qwen2-MoE."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.distributed.group import TensorParallel
from engine.models.blocks import LlamaShape, MlpFactory
from engine.models.qwen2_moe import QWEN_MOE_WEIGHTS, qwen_moe_mlps
from engine.models.qwen3 import Qwen3ForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    weight_mapping = QWEN_MOE_WEIGHTS

    @classmethod
    def layer_mlps(
        cls, hf_config: PretrainedConfig, shape: LlamaShape, tp: TensorParallel | None
    ) -> MlpFactory:
        return qwen_moe_mlps(hf_config, shape, tp)
