"""gpt-oss's mixture of experts: a router with a bias, experts with biases and a clamped SwiGLU.

The experts keep the checkpoints' layout, so they load as stored: gate_up_proj [E, H, 2I]
(multiplied from the right, x @ W, with each expert's gate and up columns interleaved: gate in
the even columns, up in the odd ones), gate_up_proj_bias [E, 2I], down_proj [E, I, H] and
down_proj_bias [E, H]. The activation is (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)
with g = clamp(gate, max=limit). Routing: the top-k router logits, softmax over those k.
On the CPU the experts run as grouped GEMMs (engine.layers.moe.compute); on CUDA through the
fused-MoE Triton kernels, which read the transposed layout through its strides and add the
biases (no host sync, so decode steps can be captured in CUDA graphs).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.moe.compute import grouped_experts
from engine.layers.moe.routing import RouterSpec, route


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[..., 2I] with gate and up interleaved -> [..., I]."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class BiasedExperts(nn.Module):
    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.local_intermediate_size = intermediate_size  # every rank's: never split
        self.alpha, self.limit = alpha, limit
        size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * size), False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * size), False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, size, hidden_size), False)
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size), False)

    def _gate_up(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.gate_up_proj_bias[expert], rows, self.gate_up_proj[expert])

    def _down(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.down_proj_bias[expert], rows, self.down_proj[expert])

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate_up, self.alpha, self.limit)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights/ids [T, k] -> the weighted sum of each token's experts."""
        if x.is_cuda:  # the fused kernels read the transposed layout through its strides
            from kernels import fused_moe

            return fused_moe(
                x,
                self.gate_up_proj.transpose(1, 2),
                self.down_proj.transpose(1, 2),
                weights,
                ids,
                self.gate_up_proj_bias,
                self.down_proj_bias,
                self._activate,
            )
        return grouped_experts(
            x, weights, ids, self.num_experts, self._gate_up, self._down, self._activate
        )


class BiasedMoeBlock(nn.Module):
    """`router` (a linear with a bias) -> `experts`; module names follow the checkpoints'."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        router: RouterSpec,
        alpha: float,
        limit: float,
    ) -> None:
        super().__init__()
        self.spec = router
        self.router = nn.Linear(hidden_size, router.num_experts, bias=True)
        self.experts = BiasedExperts(
            router.num_experts, hidden_size, intermediate_size, alpha, limit
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router(x), self.spec)
        return self.experts(x, weights, ids)
