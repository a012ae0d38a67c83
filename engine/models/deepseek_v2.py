"""DeepSeek-V2 (and V2-Lite): DeepSeek-V3's layers (multi-head latent attention with its
compressed cache, routed plus shared experts, dense first layers) with V2's router: softmax
probabilities, top-k over all experts (topk_method "greedy") or only over the topk_group groups
with the best single expert (group_limited_greedy), times routed_scaling_factor, no correction
bias and no renormalization; the dense and shared MLPs take mlp_bias.

norm_topk_prob is refused when set: transformers' V2 router ignores it while DeepSeek's own code
renormalizes, so the two references disagree (released V2 configs leave it false).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.layers.moe import RouterSpec, Scoring
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM, refuse_fields

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    @classmethod
    def router_spec(cls, hf_config: PretrainedConfig) -> RouterSpec:
        refuse_fields(
            hf_config,
            {
                "topk_method": ("greedy", "group_limited_greedy"),
                "scoring_func": ("softmax",),
                "norm_topk_prob": (False,),
            },
        )
        grouped = hf_config.topk_method == "group_limited_greedy"
        return RouterSpec(
            hf_config.n_routed_experts,
            hf_config.num_experts_per_tok,
            Scoring.SOFTMAX_GROUP_LIMITED,
            num_groups=hf_config.n_group if grouped else 1,
            topk_groups=hf_config.topk_group if grouped else 1,
            routed_scaling=float(hf_config.routed_scaling_factor),
        )
