"""The attention backend interface: what the model runner hands every attention layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class AttentionMetadata:
    """Describes one flat step batch of B sequences and T tokens (prefill chunks and decodes mixed).

    Sequence i owns query tokens query_start_loc[i]:query_start_loc[i+1]; they are the last
    query_lens[i] tokens of its context of seq_lens[i] tokens (cached + new), so query token j of
    sequence i sits at position seq_lens[i] - query_lens[i] + j and attends causally to context
    positions 0..that position, all read through block_tables[i].
    """

    slot_mapping: (
        torch.Tensor
    )  # [T] int64: cache slot (block * block_size + offset) per new token; -1 skips
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative query lengths (cu_seqlens_q)
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies so CPU backends never sync to read them.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Per-step state a backend derives once from the fields above and reuses in every layer
    # (the torch backend's gather plan); None until the first layer builds it.
    backend_plan: Any = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    """Stores the step's K/V into the paged cache, then attends each query over its context.

    k_cache / v_cache: [num_blocks, block_size, num_kv_heads, head_dim] for one layer.
    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]. Returns [T, num_heads, head_dim].
    window: a sliding-window layer's window; the query at position p then sees only positions
    p - window + 1 .. p, and a block table may name freed blocks (any id) before that.
    softcap: each scaled score s becomes softcap * tanh(s / softcap) before the softmax.
    sinks: [num_heads] float32 attention-sink logits (gpt-oss): each head's softmax denominator
    gains exp(sink), as if one more key scored it and contributed no value.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def attend_from_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        num_heads: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """A step straight from the fused projection qkv: rotary, KV store and attention in
        one go, [T, num_heads, head_dim]; None where the backend has no such path for this step
        (the model then rotates and calls forward)."""
        ...
