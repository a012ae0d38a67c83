"""Plain-torch twins of the Triton kernels: same signatures, `_ref` suffix.

They define the semantics the kernels must match, so they favour obviousness over speed
(per-sequence Python loops, fp32 math) and run on any device without Triton.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def unified_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention, one sequence at a time, in fp32; writes and returns `out`.

    Query token j of sequence i sits at position seq_lens[i] - qlen_i + j and attends to the
    context positions 0..that position (only the last `window` of them under a sliding
    window; scores soft-capped by softcap), gathered through block_tables[i]. sinks [Hq]: each
    head's sink logit joins its softmax as a score with no value. max_query_len, max_seq_len
    and num_splits only tune the kernel and are ignored here.
    """
    del max_query_len, max_seq_len, num_splits
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[i, :num_blocks].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        # Blocks wholly outside every query's window may be freed (any content): never read.
        k = k.masked_fill(~visible.any(0)[:, None, None], 0.0)
        v = v.masked_fill(~visible.any(0)[:, None, None], 0.0)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def reshape_and_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache.view(num_blocks * block_size, Hkv, D)[slot] = k[t] for every slot >= 0."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF LlamaRMSNorm, with the residual add first when `residual` is given."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = (normed.to(x.dtype) * weight).to(x.dtype)
    return out if residual is None else (out, residual)


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> None:
    """Neox rotary in place: per head, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), in fp32."""
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, R/2] each
    for x in (q, k):
        heads = x.view(x.shape[0], -1, head_dim)
        x1 = heads[..., : rotary_dim // 2].float()
        x2 = heads[..., rotary_dim // 2 : rotary_dim].float()
        c, s = cos[:, None, :], sin[:, None, :]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        heads[..., :rotary_dim] = rotated.to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., 2*I] = [gate; up] -> silu(gate) * up, in x.dtype like the unfused MLP."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def quant_matmul_triton_ref(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ dequantized(weight)^T (+ bias) in fp32, returned in x.dtype.

    8 bits: data int8 [out, in], weight = q * scale. 4 bits: data uint8 [out, in // 2], each run
    of 32 inputs 16 bytes with inputs 0..15 in the low nibbles and 16..31 in the high ones,
    weight = q * scale + min. scales (and mins) [out, in // group_size].
    """
    out_features = data.shape[0]
    if bits == 4:
        runs = data.reshape(out_features, -1, 1, 16)
        q = torch.cat([runs & 0xF, runs >> 4], dim=2).reshape(out_features, -1)
    else:
        q = data
    grouped = q.float().reshape(out_features, -1, group_size)
    weight = grouped * scales.float()[..., None]
    if bits == 4 and mins is not None:
        weight = weight + mins.float()[..., None]
    out = x.float() @ weight.reshape(out_features, -1).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    bias13: torch.Tensor | None = None,
    bias2: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, H] through each token's k experts (w13 [E, 2I, H] = [gate; up], w2 [E, H, I], with
    their biases [E, 2I], [E, H] where given; activation: silu(gate) * up where None), summed
    with the routing weights [T, k], accumulated in float32."""
    act = silu_and_mul_ref if activation is None else activation
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for slot in range(ids.shape[1]):
        for expert in ids[:, slot].unique().tolist():
            tokens = (ids[:, slot] == expert).nonzero().squeeze(1)
            b13 = None if bias13 is None else bias13[expert].float()
            b2 = None if bias2 is None else bias2[expert].float()
            gate_up = F.linear(x[tokens].float(), w13[expert].float(), b13)
            down = F.linear(act(gate_up), w2[expert].float(), b2)
            out.index_add_(0, tokens, down * weights[tokens, slot, None].float())
    return out.to(x.dtype)


def lora_shrink_expand_ref(
    x: torch.Tensor,
    a: torch.Tensor,
    b_t: torch.Tensor,
    out: torch.Tensor,
    order: torch.Tensor,
    seg_slots: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    max_seg_len: int,
    columns: int,
) -> torch.Tensor:
    """out plus each segment's rows' LoRA term (x @ a[slot block].T @ b_t[slot block]), in
    place: the shrink in float32, rounded to b_t's dtype, the expand in float32."""
    for slot, start, length in zip(
        seg_slots.tolist(), seg_starts.tolist(), seg_lens.tolist(), strict=True
    ):
        rows = order[start : start + length]
        block = slice(slot * columns, (slot + 1) * columns)
        hidden = (x[rows].float() @ a[block].float().T).to(b_t.dtype)
        term = hidden.float() @ b_t[block].float()
        out[rows] = (out[rows].float() + term).to(out.dtype)
    return out
