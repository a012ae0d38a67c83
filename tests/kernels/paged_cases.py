"""Builds paged-attention test batches: per-sequence dense K/V scattered into a shuffled cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    dense_k: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]: what the cache holds
    dense_v: list[torch.Tensor]
    query_lens: list[int]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())

    def attention_args(self, out: torch.Tensor, scale: float) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            out,
            self.query_start_loc,
            self.seq_lens,
            self.block_tables,
            scale,
            self.max_query_len,
            self.max_seq_len,
        )


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Random q/K/V; each sequence's blocks are drawn from a shuffled pool of physical blocks.

    Unused cache slots hold NaN, so any read past a sequence's context poisons the output.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.zeros((len(seq_lens), max(blocks_per_seq)), dtype=torch.int32)
    dense_k, dense_v = [], []
    for i, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        table = [pool.pop() for _ in range(n)]
        block_tables[i, :n] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(seq_len):
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        dense_k.append(k.to(device))
        dense_v.append(v.to(device))
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedBatch(
        q=q.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        dense_k=dense_k,
        dense_v=dense_v,
        query_lens=list(query_lens),
    )


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Oracle: SDPA of the last len(q) positions over all len(k) positions, bottom-right causal.

    q [L, Hq, D]; k, v [S, Hkv, D] -> [L, Hq, D] in fp32.
    """
    q_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q_len)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().repeat_interleave(group, dim=1).transpose(0, 1),
        v.float().repeat_interleave(group, dim=1).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)
