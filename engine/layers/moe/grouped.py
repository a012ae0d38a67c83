"""DeepSeek's mixture of experts: a router with grouped top-k (V3: over sigmoid scores with a
correction bias, engine.layers.moe.routing.grouped_topk; V2: group-limited greedy over softmax
probabilities, engine.layers.moe.routing.route), the routed experts stacked as every
MoE family keeps them (FusedExperts: the same grouped GEMMs on the CPU and fused-MoE kernel on
CUDA), and shared experts every token goes through, added unscaled. Module names follow the
checkpoints' (mlp.gate, mlp.gate.e_score_correction_bias, mlp.experts, mlp.shared_experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.moe.layer import FusedExperts
from engine.layers.moe.routing import RouterSpec, Scoring, grouped_topk, route


class GroupedTopKRouter(nn.Module):
    """The router's weight and correction bias stay float32 whatever the model's dtype (as
    transformers keeps them): routing picks among near ties, and bf16 logits would pick
    differently."""

    def __init__(self, hidden_size: int, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        experts = spec.num_experts
        self.weight = nn.Parameter(torch.empty(experts, hidden_size, dtype=torch.float32), False)
        # The bias only V3's scoring has (it steers the choice, not the weights).
        self.e_score_correction_bias: nn.Parameter | None = None
        if spec.scoring is Scoring.SIGMOID_GROUPED:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(experts, dtype=torch.float32), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        if self.e_score_correction_bias is None:
            return route(logits, self.spec)
        return grouped_topk(logits, self.e_score_correction_bias, self.spec)


class SharedExpertsMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        router: RouterSpec,
        shared_experts: nn.Module,
    ) -> None:
        super().__init__()
        self.gate = GroupedTopKRouter(hidden_size, router)
        self.experts = FusedExperts(router.num_experts, hidden_size, intermediate_size)
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids) + self.shared_experts(x)
