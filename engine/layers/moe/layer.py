"""The MoE layer: a router, every expert's weights stacked, and an optional shared expert.

`FusedExperts` holds w13 [E, 2I, H] ([gate; up] rows of each expert) and w2 [E, H, I]. Under
tensor parallelism each rank holds its slice of every expert's intermediate dim (rows of w13's
gate and up parts, columns of w2), computes its partial down projection and all-reduces it, as
a row-parallel MLP does. The loader fills one expert's projection at a time (`expert_slot`).

Quantized experts (int8, int4 weight-only, quantized at load) keep one `QuantizedWeight` per
expert and projection and multiply through engine.quantization's kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed.group import TensorParallel
from engine.layers.moe.compute import ExpertGemm, grouped_experts, plain_gemms
from engine.layers.moe.routing import RouterSpec, route
from engine.layers.parallel import TensorSlice, balanced_slice
from engine.quantization.matmul import quantized_linear
from engine.quantization.weights import QuantizedWeight

W13, W2 = "w13", "w2"


class FusedExperts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.tp = tp
        self.part = (
            TensorSlice(0, 0, intermediate_size, intermediate_size)
            if tp is None
            else balanced_slice(intermediate_size, tp)
        )
        local = self.part.length
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size), False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, local), False)
        self.quantized: tuple[list[QuantizedWeight], list[QuantizedWeight]] | None = None

    @property
    def local_intermediate_size(self) -> int:
        return self.part.length

    # -- loading --------------------------------------------------------------------------

    def slots(self, param: str) -> int:
        """How many (expert, shard) pieces fill `param`."""
        return self.num_experts * (2 if param == W13 else 1)

    def expert_slot(self, param: str, expert: int, shard: int | None) -> torch.Tensor:
        """The destination of one expert's checkpoint projection (shard 0: gate, 1: up of w13)."""
        if param == W13:
            local = self.part.length
            return self.w13.data[expert].narrow(0, (shard or 0) * local, local)
        return self.w2.data[expert]

    def checkpoint_slice(self, param: str) -> TensorSlice | None:
        """The slice of one expert's checkpoint projection this rank holds (None: all of it)."""
        if self.tp is None:
            return None
        part = self.part
        return part if param == W13 else TensorSlice(1, part.start, part.length, part.full)

    # -- quantization ---------------------------------------------------------------------

    def use_quantized(self, w13: list[QuantizedWeight], w2: list[QuantizedWeight]) -> None:
        """Compute from these per-expert quantized weights and free the plain ones."""
        if self.tp is not None:
            raise NotImplementedError("quantized experts are not tensor-parallel")
        self.quantized = (w13, w2)
        self.w13 = nn.Parameter(self.w13.detach().to("meta"), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.detach().to("meta"), requires_grad=False)

    def quantized_tensors(self) -> list[torch.Tensor]:
        if self.quantized is None:
            return []
        return [t for weight in (*self.quantized[0], *self.quantized[1]) for t in weight.tensors()]

    def _gemms(self) -> tuple[ExpertGemm, ExpertGemm]:
        if self.quantized is None:
            return plain_gemms(self.w13, self.w2)
        w13, w2 = self.quantized
        return (
            lambda e, rows: quantized_linear(rows, w13[e]),
            lambda e, rows: quantized_linear(rows, w2[e]),
        )

    # -- forward --------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights/ids [T, k] -> the weighted sum of each token's experts."""
        if x.is_cuda and self.quantized is None:
            from kernels import fused_moe

            out = fused_moe(x, self.w13, self.w2, weights, ids)
        else:
            gate_up, down = self._gemms()
            out = grouped_experts(x, weights, ids, self.num_experts, gate_up, down)
        return out if self.tp is None else self.tp.all_reduce(out)


class SparseMoeBlock(nn.Module):
    """router (`gate`) -> experts, plus a shared expert scaled by sigmoid(shared_expert_gate)
    where the family has one (Qwen2-MoE). Module names follow the checkpoints'."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        router: RouterSpec,
        tp: TensorParallel | None = None,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.router = router
        self.gate = nn.Linear(hidden_size, router.num_experts, bias=False)
        self.experts = FusedExperts(router.num_experts, hidden_size, intermediate_size, tp)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            None if shared_expert is None else nn.Linear(hidden_size, 1, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.router)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out
