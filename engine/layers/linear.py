"""Linear layers: one matmul entry point, and fused projections (QKV, gate-up).

On the CPU each layer computes through the backend its plan names for the call's row count
(engine.layers.matmul); the plan is measured per machine at start-up and the weights are
packed once for it (engine.layers.matmul_tuning.apply_plan). Until then, and on CUDA, a layer
is a plain `F.linear`. A quantized layer (engine.quantization) holds a `QuantizedWeight` instead
of its plain weight and computes through the quantized matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.matmul import ATEN, MatmulPlan, PackedWeights, pack, run
from engine.quantization.matmul import quantized_linear
from engine.quantization.weights import QuantizedWeight


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
    quantized: QuantizedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return quantized_linear(x, self.quantized, self.bias)
        return linear(x, self.weight, self.bias, self.plan, self.packed)

    def use_quantized(self, weight: QuantizedWeight, keep_plain_weight: bool = False) -> None:
        """Compute through `weight` from now on and free the plain weight (unless it is shared,
        e.g. with a tied embedding that still reads it)."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {weight.shape} for a {self.weight.shape} layer")
        self.quantized = weight.to(self.weight.device)
        self.packed = None
        if not keep_plain_weight:
            self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)

    def use_plan(self, plan: MatmulPlan, keep_plain_weight: bool = False) -> None:
        """Compute through `plan` from now on: pack the weight once for it, and free the plain
        weight when no backend of the plan reads it (unless keep_plain_weight: e.g. it is shared
        with a tied embedding)."""
        if self.quantized is not None:
            return  # the quantized matmul has its own kernels
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


def shared_parameter_ids(model: nn.Module) -> set[int]:
    """ids of the parameters two modules hold (a tied embedding and lm_head): a layer that
    changes how it stores its weight must keep such a one for the other holder."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    return {key for key, count in uses.items() if count > 1}
