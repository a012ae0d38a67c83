"""Which experts each token goes to, and with what weight: exactly as each family defines it.

- SOFTMAX_TOPK (Qwen2-MoE, Qwen3-MoE): softmax over all experts' logits in float32, the k
  largest probabilities, divided by their sum when the family renormalizes (norm_topk_prob).
- TOPK_SOFTMAX (Mixtral): the k largest logits, softmax over those k only (which equals the
  softmax-then-renormalize of the other scoring up to rounding).
- SIGMOID_GROUPED (DeepSeek-V3's noaux_tc, `grouped_topk`): sigmoid scores; a per-expert
  correction bias is added for the choice only; experts are split into num_groups groups, each
  group scored by the sum of its two best biased scores, only the topk_groups best groups are
  eligible, and the k best biased scores among them are chosen; their weights are the unbiased
  scores, divided by their sum where the family renormalizes, times routed_scaling.
- SOFTMAX_GROUP_LIMITED (DeepSeek-V2's greedy and group_limited_greedy): softmax over all
  experts in float32; each group scored by its best probability, the experts outside the
  topk_groups best groups zeroed, the k largest kept, times routed_scaling (never
  renormalized). One group of all experts is plain greedy top-k.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Scoring(enum.Enum):
    SOFTMAX_TOPK = "softmax_topk"
    TOPK_SOFTMAX = "topk_softmax"
    SIGMOID_GROUPED = "sigmoid_grouped"
    SOFTMAX_GROUP_LIMITED = "softmax_group_limited"


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    scoring: Scoring
    renormalize: bool = False  # SOFTMAX_TOPK: the k weights are divided by their sum
    # SIGMOID_GROUPED and SOFTMAX_GROUP_LIMITED: expert groups, how many of them a token may
    # use, and the factor on the chosen weights.
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} experts of {self.num_experts}")
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(
                f"{self.num_experts} experts in {self.num_groups} groups, "
                f"{self.topk_groups} of them used"
            )


def route(logits: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k])."""
    if spec.scoring is Scoring.SIGMOID_GROUPED:
        raise ValueError("grouped sigmoid routing needs its correction bias: use grouped_topk")
    if spec.scoring is Scoring.SOFTMAX_GROUP_LIMITED:
        return _group_limited_greedy(logits, spec)
    if spec.scoring is Scoring.TOPK_SOFTMAX:
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _eligible(group_scores: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """[T, groups] scores -> [T, E] bool: the experts of each token's topk_groups best groups."""
    tokens, groups = group_scores.shape
    best_groups = torch.topk(group_scores, spec.topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, best_groups, True)
    per_group = spec.num_experts // groups
    return group_mask.unsqueeze(-1).expand(tokens, groups, per_group).reshape(tokens, -1)


def _group_limited_greedy(
    logits: torch.Tensor, spec: RouterSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    if spec.topk_groups < spec.num_groups:
        per_group = spec.num_experts // spec.num_groups
        group_scores = probs.view(probs.shape[0], spec.num_groups, per_group).amax(dim=-1)
        probs = probs.masked_fill(~_eligible(group_scores, spec), 0.0)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1, sorted=False)
    return weights * spec.routed_scaling, ids


def grouped_topk(
    logits: torch.Tensor, correction_bias: torch.Tensor, spec: RouterSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """SIGMOID_GROUPED routing (see the module docstring): router logits [T, E] and the
    correction bias [E] -> (weights float32 [T, k], expert ids int64 [T, k])."""
    scores = logits.float().sigmoid()
    choice = scores + correction_bias.float()
    per_group = spec.num_experts // spec.num_groups
    group_scores = choice.view(-1, spec.num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    choice = choice.masked_fill(~_eligible(group_scores, spec), float("-inf"))
    ids = torch.topk(choice, spec.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.routed_scaling, ids
