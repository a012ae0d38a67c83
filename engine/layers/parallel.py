"""Tensor-parallel layers: each rank holds a slice of the weight and computes its part.

- Column-parallel (QKV, gate-up): each rank holds a row range of every fused part; its output
  is this rank's heads / intermediate features, consumed locally.
- Row-parallel (o_proj, down_proj): each rank holds a column range; the partial products are
  summed by one all-reduce, the bias added once after it.
- Vocab-parallel embedding and lm_head: each rank holds a row range of the vocabulary (padded
  to equal ranges); the embedding sums the ranks' lookups, the lm_head gathers the ranks'
  logits before sampling.

Each layer names the slice of the checkpoint tensor it holds (`checkpoint_slice`), so the loader
reads only that slice from the file, never the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from engine.distributed.group import TensorParallel
from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear, MergedLinear, linear
from engine.lora.segmented import add_lora_terms


@dataclass(frozen=True)
class TensorSlice:
    """Indices start:start+length of a checkpoint tensor along dim, whose size there is full."""

    dim: int
    start: int
    length: int
    full: int


@runtime_checkable
class ShardedLayer(Protocol):
    def checkpoint_slice(self, param: str, shard: int | None) -> TensorSlice | None:
        """The slice of checkpoint tensor `param` ("weight", "bias") for fused part `shard`
        this rank holds; None: the whole tensor (replicated)."""
        ...


@dataclass(frozen=True)
class HeadSplit:
    """This rank's attention heads. KV groups (a KV head and the q heads that read it) are
    dealt out whole, as evenly as they go (9 heads in 3 groups over 2 ranks: 6 and 3); with
    fewer KV heads than ranks, each KV head is replicated on the ranks that share its group."""

    num_heads: int
    num_kv_heads: int
    q: TensorSlice  # rows of q_proj
    kv: TensorSlice  # rows of k_proj and of v_proj


def balanced_range(count: int, rank: int, size: int) -> tuple[int, int]:
    """(start, length) of rank's share of count items dealt out as evenly as they go."""
    start, end = count * rank // size, count * (rank + 1) // size
    return start, end - start


def split_heads(num_heads: int, num_kv_heads: int, head_dim: int, tp: TensorParallel) -> HeadSplit:
    size, rank = tp.size, tp.rank
    group = num_heads // num_kv_heads  # q heads per KV head
    if num_kv_heads >= size:
        first_kv, local_kv = balanced_range(num_kv_heads, rank, size)
        first_q, local_q = first_kv * group, local_kv * group
    elif size % num_kv_heads == 0 and num_heads % size == 0:
        local_q = num_heads // size
        first_q, local_kv = rank * local_q, 1
        first_kv = first_q // group
    else:
        raise ValueError(
            f"tensor_parallel_size={size} cannot split {num_heads} attention heads with "
            f"{num_kv_heads} KV heads: use at most {num_kv_heads} ranks, or a multiple of it "
            "that divides the attention heads"
        )
    return HeadSplit(
        local_q,
        local_kv,
        TensorSlice(0, first_q * head_dim, local_q * head_dim, num_heads * head_dim),
        TensorSlice(0, first_kv * head_dim, local_kv * head_dim, num_kv_heads * head_dim),
    )


def balanced_slice(full: int, tp: TensorParallel, dim: int = 0) -> TensorSlice:
    start, length = balanced_range(full, tp.rank, tp.size)
    return TensorSlice(dim, start, length, full)


class ColumnParallelLinear(MergedLinear):
    """This rank's rows of each fused part ([q; k; v] or [gate; up]), stacked."""

    def __init__(
        self, in_features: int, parts: list[TensorSlice], bias: bool = False, gated: bool = False
    ) -> None:
        super().__init__(in_features, [part.length for part in parts], bias=bias, gated=gated)
        self.parts = list(parts)

    def checkpoint_slice(self, param: str, shard: int | None) -> TensorSlice | None:
        return self.parts[shard or 0]


class RowParallelLinear(Linear):
    """This rank's input columns; the outputs of all ranks are summed."""

    def __init__(
        self, columns: TensorSlice, out_features: int, tp: TensorParallel, bias: bool = False
    ) -> None:
        super().__init__(columns.length, out_features, bias=bias)
        self.columns = columns
        self.tp = tp

    def checkpoint_slice(self, param: str, shard: int | None) -> TensorSlice | None:
        return self.columns if param == "weight" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_quantized:
            raise NotImplementedError("quantized weights are not tensor-parallel")
        partial = linear(x, self.weight, None, self.plan, self.packed)
        if self.lora is not None:  # this rank's input columns' part of the LoRA term too
            partial = add_lora_terms(self.lora, x, partial)
        out = self.tp.all_reduce(partial)
        return out if self.bias is None else out + self.bias


def vocab_slice(vocab_size: int, tp: TensorParallel) -> tuple[int, TensorSlice]:
    """(rows each rank holds, the checkpoint rows this rank reads): the vocabulary padded up
    to a multiple of the rank count, so every rank's range has the same size."""
    rows = -(-vocab_size // tp.size)
    start = min(tp.rank * rows, vocab_size)
    return rows, TensorSlice(0, start, min(rows, vocab_size - start), vocab_size)


class VocabParallelEmbedding(VocabEmbedding):
    def __init__(self, vocab_size: int, embedding_dim: int, tp: TensorParallel) -> None:
        rows, self.rows = vocab_slice(vocab_size, tp)
        super().__init__(rows, embedding_dim)
        self.tp = tp

    def checkpoint_slice(self, param: str, shard: int | None) -> TensorSlice | None:
        return self.rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            raise NotImplementedError("quantized weights are not tensor-parallel")
        local = ids - self.rows.start
        outside = (local < 0) | (local >= self.rows.length)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(Linear):
    """This rank's vocabulary rows; forward returns the logits of the whole vocabulary."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        rows, self.rows = vocab_slice(vocab_size, tp)
        super().__init__(hidden_size, rows, bias=False)
        self.tp = tp
        self.vocab_size = vocab_size

    def checkpoint_slice(self, param: str, shard: int | None) -> TensorSlice | None:
        return self.rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_quantized:
            raise NotImplementedError("quantized weights are not tensor-parallel")
        local = linear(x, self.weight, None, self.plan, self.packed)
        if self.lora is not None:
            local = add_lora_terms(self.lora, x, local)
        return self.tp.all_gather_last_dim(local)[..., : self.vocab_size]
