"""A Linear layer whose output rows stack several checkpoint projections (fused QKV, gate-up)."""

from __future__ import annotations

from torch import nn


class MergedLinear(nn.Linear):
    """Output rows are the concatenation of shards (e.g. [q; k; v]); the loader fills each shard."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = list(shard_sizes)

    def shard_offset(self, shard: int) -> int:
        return sum(self.shard_sizes[:shard])
