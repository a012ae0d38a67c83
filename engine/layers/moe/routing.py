"""Which experts each token goes to, and with what weight: exactly as each family defines it.

- SOFTMAX_TOPK (Qwen2-MoE, Qwen3-MoE): softmax over all experts' logits in float32, the k
  largest probabilities, divided by their sum when the family renormalizes (norm_topk_prob).
- TOPK_SOFTMAX (Mixtral): the k largest logits, softmax over those k only (which equals the
  softmax-then-renormalize of the other scoring up to rounding).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Scoring(enum.Enum):
    SOFTMAX_TOPK = "softmax_topk"
    TOPK_SOFTMAX = "topk_softmax"


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    scoring: Scoring
    renormalize: bool = False  # SOFTMAX_TOPK: the k weights are divided by their sum

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} experts of {self.num_experts}")


def route(logits: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k])."""
    if spec.scoring is Scoring.TOPK_SOFTMAX:
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
