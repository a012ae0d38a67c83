"""Linear layers: one matmul entry point, and fused projections (QKV, gate-up).

On the CPU, fp32 matmuls go through oneDNN instead of torch's default (MKL sgemm): on the AMD
EPYC we develop on, MKL runs about half as fast at every batch size and worst at the small
ones decode steps have (measured per layer shape in bench/RESULTS.md, "CPU matmul"); oneDNN
reaches the memory bandwidth for one row and twice MKL's FLOP/s for prefill-sized ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = _onednn_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, for x [..., in] and weight [out, in]."""
    if _ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32 and x.numel():
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear computed through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Output rows are the concatenation of shards (e.g. [q; k; v]); the loader fills each shard."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = list(shard_sizes)

    def shard_offset(self, shard: int) -> int:
        return sum(self.shard_sizes[:shard])
