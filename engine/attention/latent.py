"""Paged multi-head latent attention (DeepSeek's MLA) in plain torch, on any device.

An MLA layer caches one row per token: its compressed latent (kv_lora_rank features, after the
latent norm) followed by its shared rope key (qk_rope_head_dim features, rotated). The paged
cache of such a layer is [num_blocks, block_size, 1, latent_size] (engine.kv_cache), so a token
costs latent_size features per layer instead of 2 * num_kv_heads * head_dim.

Prefill chunks decompress their sequence's cached rows back into per-head keys and values
(the layer's `expand`: kv_b_proj over the latents, the rope key shared by every head) and
attend causally over them. Decodes (one query token) attend in the latent space instead (the
absorbed form): each head's no-rope query is turned into the latent space by its slice of
kv_b_proj's key rows, scored against the cached rows themselves, and the weighted sum of
latents is turned into the head's value by its slice of the value rows; the same arithmetic
reassociated, without expanding the whole context per step. The engine's C++ and Triton paged
kernels, which read per-head K/V blocks, are not used for these layers, and CUDA graphs are not
captured (each step's gathers are planned on the host).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata

# cached rows [S, latent_size] -> (keys [S, heads, qk_head_dim], values [S, heads, v_head_dim])
Expand = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Absorbed:
    """kv_b_proj's rows per head: a cached latent c gives head h the no-rope key
    key_up[h] @ c and the value value_up[h] @ c."""

    key_up: torch.Tensor  # [heads, qk_nope_head_dim, kv_lora_rank]
    value_up: torch.Tensor  # [heads, v_head_dim, kv_lora_rank]


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
    absorbed: Absorbed,
    scale: float,
) -> torch.Tensor:
    """q [T, heads, qk_head_dim] (the step's rows stored already) -> [T, heads, v_head_dim].

    The contexts of every prefill chunk are decompressed by one `expand` call for the step;
    query j of a sequence sits at position seq_len - query_len + j and sees positions 0..that
    one. Decodes attend through `absorbed`."""
    heads, value_dim = absorbed.value_up.shape[:2]
    out = torch.empty((q.shape[0], heads, value_dim), dtype=q.dtype, device=q.device)
    query_starts = list(itertools.accumulate(meta.query_lens_cpu, initial=0))
    prefills = [i for i, n in enumerate(meta.query_lens_cpu) if n > 1]
    decodes = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
    if prefills:
        contexts = [_context(cache, meta.block_tables[i], meta.seq_lens_cpu[i]) for i in prefills]
        keys, values = expand(torch.cat(contexts))
        key_start = 0
        for i in prefills:
            start, query_len, seq_len = (
                query_starts[i],
                meta.query_lens_cpu[i],
                meta.seq_lens_cpu[i],
            )
            key_rows = slice(key_start, key_start + seq_len)
            key_start += seq_len
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
    if decodes:
        rows = torch.tensor([query_starts[i] for i in decodes], device=q.device)
        _attend_absorbed(q.index_select(0, rows), cache, meta, decodes, absorbed, scale, out, rows)
    return out


def _attend_absorbed(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    seqs: list[int],
    absorbed: Absorbed,
    scale: float,
    out: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """One query row per sequence in `seqs`: q [D, heads, qk_head_dim] -> out[rows]."""
    nope, rank = absorbed.key_up.shape[1:]
    q_nope, q_rope = q.split([nope, q.shape[-1] - nope], dim=-1)
    # [D, heads, rank]: each head's query in the latent space, then its rope part beside it
    q_latent = torch.einsum("dhn,hnr->dhr", q_nope, absorbed.key_up)
    queries = torch.cat((q_latent, q_rope), dim=-1)
    latents = []
    for row, i in enumerate(seqs):
        context = _context(cache, meta.block_tables[i], meta.seq_lens_cpu[i])
        weights = torch.softmax((queries[row] @ context.T).float() * scale, dim=-1)
        latents.append(weights.to(context.dtype) @ context[:, :rank])
    attended = torch.einsum("dhr,hvr->dhv", torch.stack(latents), absorbed.value_up)
    out.index_copy_(0, rows, attended.to(out.dtype))
