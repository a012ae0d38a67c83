"""Paged multi-head latent attention (DeepSeek's MLA) in plain torch, on any device.

An MLA layer caches one row per token: its compressed latent (kv_lora_rank features, after the
latent norm) followed by its shared rope key (qk_rope_head_dim features, rotated). The paged
cache of such a layer is [num_blocks, block_size, 1, latent_size] (engine.kv_cache), so a token
costs latent_size features per layer instead of 2 * num_kv_heads * head_dim.

Attention decompresses each sequence's cached rows back into per-head keys and values (the
layer's `expand`: kv_b_proj over the latents, the rope key shared by every head) and attends
causally over them. This is the reference form: the engine's C++ and Triton paged kernels,
which read per-head K/V blocks, are not used for these layers, and CUDA graphs are not
captured (each step's gathers are planned on the host).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata

# cached rows [S, latent_size] -> (keys [S, heads, qk_head_dim], values [S, heads, v_head_dim])
Expand = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def store_latent(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write the step's rows [T, latent_size] into their cache slots (slot -1 skips a token)."""
    flat = cache.view(-1, cache.shape[-1])
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        rows, slot_mapping = rows[keep], slot_mapping[keep]
    flat.index_copy_(0, slot_mapping, rows.to(cache.dtype))


def _context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A sequence's cached rows [seq_len, latent_size], read through its block table."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-seq_len // block_size)]
    return cache.index_select(0, blocks).view(-1, cache.shape[-1])[:seq_len]


def attend_latent(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    expand: Expand,
    scale: float,
) -> torch.Tensor:
    """q [T, heads, qk_head_dim] (the step's rows stored already) -> [T, heads, v_head_dim].

    Every sequence's context is decompressed by one `expand` call for the whole step; query j
    of a sequence sits at position seq_len - query_len + j and sees positions 0..that one."""
    contexts = [
        _context(cache, meta.block_tables[i], seq_len)
        for i, seq_len in enumerate(meta.seq_lens_cpu)
    ]
    keys, values = expand(torch.cat(contexts))
    out = torch.empty(
        (q.shape[0], q.shape[1], values.shape[-1]), dtype=values.dtype, device=q.device
    )
    query_starts = itertools.accumulate(meta.query_lens_cpu, initial=0)
    key_starts = itertools.accumulate(meta.seq_lens_cpu, initial=0)
    for start, key_start, query_len, seq_len in zip(
        query_starts, key_starts, meta.query_lens_cpu, meta.seq_lens_cpu, strict=False
    ):
        if not query_len:
            continue
        key_rows = slice(key_start, key_start + seq_len)
        query_positions = torch.arange(seq_len - query_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_positions[:, None]
        attended = F.scaled_dot_product_attention(
            q[start : start + query_len].transpose(0, 1),
            keys[key_rows].transpose(0, 1),
            values[key_rows].transpose(0, 1),
            attn_mask=mask,
            scale=scale,
        )
        out[start : start + query_len] = attended.transpose(0, 1)
    return out
