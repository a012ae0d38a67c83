"""Linear layers: one matmul entry point, and fused projections (QKV, gate-up).

On the CPU each layer computes through the backend its plan names for the call's row count
(engine.layers.matmul); the plan is measured per machine at start-up and the weights are
packed once for it (engine.layers.matmul_tuning.apply_plan). Until then, and on CUDA, a layer
is a plain `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.matmul import ATEN, MatmulPlan, PackedWeights, pack, run


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    plan: MatmulPlan = ATEN,
    packed: PackedWeights | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias, for x [..., in] and weight [out, in], through the plan's backend."""
    if plan is ATEN or x.device.type != "cpu" or not x.numel():
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    return run(plan.backend_for(rows), x, weight, bias, packed or PackedWeights())


class Linear(nn.Linear):
    """nn.Linear computed through `linear` with the layer's matmul plan."""

    plan: MatmulPlan = ATEN
    packed: PackedWeights | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.plan, self.packed)

    def use_plan(self, plan: MatmulPlan, keep_plain_weight: bool = False) -> None:
        """Compute through `plan` from now on: pack the weight once for it, and free the plain
        weight when no backend of the plan reads it (unless keep_plain_weight: e.g. it is shared
        with a tied embedding)."""
        with torch.no_grad():
            self.packed = pack(self.weight.detach(), plan)
        self.plan = plan
        if "plain" not in plan.storage() and not keep_plain_weight:
            # A meta tensor keeps the shape (and the module's repr) without the memory.
            self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)


class MergedLinear(Linear):
    """Output rows are the concatenation of shards (e.g. [q; k; v]); the loader fills each shard."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = list(shard_sizes)

    def shard_offset(self, shard: int) -> int:
        return sum(self.shard_sizes[:shard])
