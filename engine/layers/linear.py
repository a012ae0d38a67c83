"""Linear layers: one matmul entry point, and fused projections (QKV, gate-up).

On CPUs other than Intel's, fp32 matmuls go through oneDNN instead of torch's default (MKL
sgemm): MKL takes slow code paths there. On an AMD EPYC it ran about half as fast at every
batch size and worst at the small ones decode steps have, while oneDNN reached the memory
bandwidth for one row; on an Intel Xeon (Sapphire Rapids) MKL matched oneDNN for prefill and
decoded a single stream 18% faster (bench/RESULTS.md, "CPU matmul").
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def cpu_vendor() -> str:
    """The CPU vendor id from /proc/cpuinfo (e.g. GenuineIntel, AuthenticAMD); "" if unknown."""
    try:
        with Path("/proc/cpuinfo").open() as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def prefers_onednn(vendor: str) -> bool:
    """Whether fp32 matmuls on this CPU vendor should bypass MKL for oneDNN."""
    return vendor != "GenuineIntel"


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = _onednn_available() and prefers_onednn(cpu_vendor())


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
