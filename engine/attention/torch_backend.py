"""Paged attention in plain torch: the CPU production path and the reference on any device.

On the CPU, decode rows and prefill chunks go through C++ kernels that read K/V straight from
the cache blocks (kernels.cpu_ops) when they could be built: one call per layer for all decodes,
one for all prefill chunks. Where torch's SDPA measures faster for prefill chunks (its bf16
matmuls run on AMX tiles), they take the portable path below instead
(engine.platforms.cpu.prefill_choice). Everything below describes the portable path.

Every layer first stores the step's K/V into the paged cache (index_copy_ on the flat slot
dimension), then reads each sequence's whole context back through its block table. Sequences
with one query token (decodes) are attended together in one padded, masked SDPA call; prefill
chunks (more than one query token) get one SDPA call each with a causal mask shifted by their
cached context. Everything that depends only on the batch shape (gather indices, masks) is built
once per step into a plan cached on the metadata (engine.attention.torch_plan), and gathered K/V
land in a workspace reused by every layer, so the per-layer work is a few large tensor ops.

A layer with a sliding window passes it to every call: the kernels start each query's sweep at
its window, the portable path masks the keys before it. Soft caps and attention sinks go to
every path likewise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.attention.torch_plan import (
    PrefillChunk,
    PrefillShape,
    TorchAttentionPlan,
    build_plan,
)
from kernels.cpu_ops import (
    cpu_kernels_available,
    paged_decode_attention,
    paged_prefill_attention,
    rotary_store_kv,
)


class TorchAttentionBackend:
    """AttentionBackend in plain torch (see the module docstring)."""

    def __init__(
        self,
        paged_kernels: bool | None = None,
        sdpa_prefill: Callable[[PrefillShape], bool] | bool = False,
    ) -> None:
        """paged_kernels: None uses the CPU attention kernels wherever they can be built.
        sdpa_prefill: with the kernels, whether prefill chunks go through SDPA instead, or a
        function that decides it per shape (asked once per shape)."""
        self._paged_kernels = paged_kernels
        self._sdpa_prefill = sdpa_prefill
        self._sdpa_prefill_by_shape: dict[PrefillShape, bool] = {}
        # Gathered K/V of the current layer; reused by every layer and step (grown on demand)
        # because fresh multi-MB buffers per layer cost page faults on the CPU.
        self._workspace: torch.Tensor | None = None

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
    ) -> torch.Tensor:
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        plan = self._plan(meta, k_cache, q, q.shape[1])

        store_kv(k, v, k_cache, v_cache, plan)
        if plan.kernels:
            return self._attend_paged(
                q.contiguous(), k_cache, v_cache, plan, scale, window, softcap, sinks
            )
        k_buf, v_buf = self._gather_buffers(plan.max_gather_blocks, k_cache)
        num_heads = q.shape[1]
        gqa = num_heads != num_kv_heads
        masks = plan.masks(window)

        decode_out = None
        if plan.num_decodes:
            q_dec = q if plan.decode_rows is None else q.index_select(0, plan.decode_rows)
            num_blocks = plan.decode_blocks.numel()
            keys = torch.index_select(k_cache, 0, plan.decode_blocks, out=k_buf[:num_blocks])
            values = torch.index_select(v_cache, 0, plan.decode_blocks, out=v_buf[:num_blocks])
            shape = (
                plan.num_decodes,
                plan.decode_blocks_per_seq * block_size,
                num_kv_heads,
                head_dim,
            )
            decode_out = _sdpa(
                q_dec.reshape(plan.num_decodes, num_heads, 1, head_dim),
                keys.view(shape).transpose(1, 2),
                values.view(shape).transpose(1, 2),
                masks.decode_mask,
                False,
                scale,
                gqa,
                softcap,
                sinks,
            ).view(plan.num_decodes, num_heads, head_dim)
            if plan.decode_rows is None:
                return decode_out

        if len(plan.prefills) == 1 and decode_out is None:
            chunk, mask = plan.prefills[0], masks.prefill_masks[0]
            return self._prefill(
                q, k, v, k_cache, v_cache, k_buf, v_buf, chunk, mask, scale, gqa, softcap, sinks
            )
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if decode_out is not None:
            out.index_copy_(0, plan.decode_rows, decode_out)
        for chunk, mask in zip(plan.prefills, masks.prefill_masks, strict=True):
            out[chunk.start : chunk.end] = self._prefill(
                q, k, v, k_cache, v_cache, k_buf, v_buf, chunk, mask, scale, gqa, softcap, sinks
            )
        return out

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
        """A CPU step from the fused projection qkv [T, (H + 2 Hkv) * D]: Neox rotary
        (cos_sin_cache as in engine.layers.rotary) and KV store in one kernel call, then the
        paged attention kernels, [T, H, D] out. None where this step or build cannot: the
        caller then rotates and calls forward.

        Otherwise rotation and store are a dozen small ops per layer (split, views, cat,
        multiplies, index_copy_) that each pass over memory or cost more dispatch than
        arithmetic."""
        if qkv.dtype != k_cache.dtype:
            return None
        plan = self._plan(meta, k_cache, qkv, num_heads)
        if not plan.kernels:
            return None
        q = rotary_store_kv(
            qkv, positions, cos_sin_cache, plan.token_slots, k_cache, v_cache, num_heads
        )
        return self._attend_paged(q, k_cache, v_cache, plan, scale, window, softcap, sinks)

    def _attend_paged(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: TorchAttentionPlan,
        scale: float,
        window: int | None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of q [T, H, D] (contiguous, K/V stored) through the CPU kernels (and SDPA
        for prefill chunks where it was chosen)."""
        out = torch.empty_like(q)
        if plan.paged_prefill is None and not plan.prefills:  # every row decodes
            paged_decode_attention(
                out,
                q,
                k_cache,
                v_cache,
                plan.decode_tables,
                plan.decode_lens,
                scale,
                window,
                softcap,
                sinks,
            )
            return out
        if plan.decode_tables is not None:
            q_dec = q.index_select(0, plan.decode_rows)
            decode_out = torch.empty_like(q_dec)
            paged_decode_attention(
                decode_out,
                q_dec,
                k_cache,
                v_cache,
                plan.decode_tables,
                plan.decode_lens,
                scale,
                window,
                softcap,
                sinks,
            )
            out.index_copy_(0, plan.decode_rows, decode_out)
        if plan.prefills:  # through SDPA, context gathered from the cache
            k_buf, v_buf = self._gather_buffers(plan.max_gather_blocks, k_cache)
            gqa = q.shape[1] != k_cache.shape[2]
            masks = plan.masks(window)
            for chunk, mask in zip(plan.prefills, masks.prefill_masks, strict=True):
                out[chunk.start : chunk.end] = self._prefill(
                    q,
                    None,
                    None,
                    k_cache,
                    v_cache,
                    k_buf,
                    v_buf,
                    chunk,
                    mask,
                    scale,
                    gqa,
                    softcap,
                    sinks,
                )
            return out
        batch = plan.paged_prefill
        paged_prefill_attention(
            out,
            q,
            k_cache,
            v_cache,
            batch.tables,
            batch.starts,
            batch.query_lens,
            batch.seq_lens,
            scale,
            window,
            softcap,
            sinks,
        )
        return out

    def fused_decode_plan(
        self, meta: AttentionMetadata, k_cache: torch.Tensor, x: torch.Tensor
    ) -> TorchAttentionPlan | None:
        """The step's plan where every sequence decodes one token through the fused CPU kernel
        with activations x of the cache's dtype (the plan is built once per step); else None."""
        if not meta.is_decode_only or x.dtype != k_cache.dtype:
            return None
        plan = self._plan(meta, k_cache, x, num_heads=0)
        return plan if plan.decodes_only_fused else None

    def _plan(
        self, meta: AttentionMetadata, k_cache: torch.Tensor, x: torch.Tensor, num_heads: int
    ) -> TorchAttentionPlan:
        """The step's plan, built by the first layer that asks and kept on the metadata."""
        if meta.backend_plan is None:
            fused = self._use_paged_kernels(x)
            sdpa = (
                fused
                and max(meta.query_lens_cpu, default=0) > 1
                and self._prefill_through_sdpa(
                    PrefillShape(x.dtype, num_heads, *k_cache.shape[2:], k_cache.shape[1])
                )
            )
            meta.backend_plan = build_plan(meta, k_cache.shape[1], x.dtype, fused, sdpa)
        return meta.backend_plan

    def _prefill_through_sdpa(self, shape: PrefillShape) -> bool:
        if isinstance(self._sdpa_prefill, bool):
            return self._sdpa_prefill
        if shape not in self._sdpa_prefill_by_shape:
            self._sdpa_prefill_by_shape[shape] = self._sdpa_prefill(shape)
        return self._sdpa_prefill_by_shape[shape]

    def _use_paged_kernels(self, q: torch.Tensor) -> bool:
        if self._paged_kernels is None:
            self._paged_kernels = (
                q.device.type == "cpu"
                and q.dtype in (torch.float32, torch.bfloat16)
                and cpu_kernels_available()
            )
        return self._paged_kernels

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        chunk: PrefillChunk,
        mask: torch.Tensor | None,
        scale: float,
        gqa: bool,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """SDPA over one chunk's context under `mask` (None: plain causal): this step's own K/V
        rows (k, v) where the chunk has no cached context, else its blocks gathered from the
        cache; k, v None: always the cache (the kernels stored the step's K/V there)."""
        if chunk.mask is None and k is not None and v is not None:
            keys, values = k[chunk.start : chunk.end], v[chunk.start : chunk.end]
        else:
            num_blocks = chunk.blocks.numel()
            kv_shape = (-1, *k_cache.shape[2:])
            keys = torch.index_select(k_cache, 0, chunk.blocks, out=k_buf[:num_blocks])
            values = torch.index_select(v_cache, 0, chunk.blocks, out=v_buf[:num_blocks])
            keys = keys.view(kv_shape)[: chunk.seq_len]
            values = values.view(kv_shape)[: chunk.seq_len]
        out = _sdpa(
            q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            mask,
            mask is None,
            scale,
            gqa,
            softcap,
            sinks,
        )
        return out.squeeze(0).transpose(0, 1)

    def _gather_buffers(
        self, num_blocks: int, k_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        block_shape = k_cache.shape[1:]
        block_numel = k_cache[0].numel()
        needed = 2 * num_blocks * block_numel
        ws = self._workspace
        if (
            ws is None
            or ws.numel() < needed
            or ws.dtype != k_cache.dtype
            or ws.device != k_cache.device
        ):
            capacity = max(needed, 0 if ws is None else ws.numel())
            ws = self._workspace = torch.empty(capacity, dtype=k_cache.dtype, device=k_cache.device)
        half = num_blocks * block_numel
        return ws[:half].view(num_blocks, *block_shape), ws[half:needed].view(
            num_blocks, *block_shape
        )


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    gqa: bool,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA of q [B, H, L, D] over k, v [B, Hkv, S, D] under an additive mask, or causal
    (L == S), or neither; with a soft cap (scores capped before the mask) or sinks (each head's
    sink logit [H] one more term of its softmax, with no value), SDPA's fused kernels give way
    to plain matmuls in float32."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    if gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask.float()
    elif causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu_(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: TorchAttentionPlan,
) -> None:
    """Write the step's K/V [T, Hkv, D] into their cache slots (tokens with slot -1 skipped)."""
    if plan.write_rows is not None:
        k = k.index_select(0, plan.write_rows)
        v = v.index_select(0, plan.write_rows)
    flat_shape = (-1, *k_cache.shape[2:])
    k_cache.view(flat_shape).index_copy_(0, plan.write_slots, k.to(k_cache.dtype))
    v_cache.view(flat_shape).index_copy_(0, plan.write_slots, v.to(v_cache.dtype))
