"""Attention through the Triton kernels: one KV-cache write plus one unified attention launch.

Triton is imported when the backend is constructed, not with this module, so CPU-only
installs can import the engine. On CPU tensors the kernels run only under TRITON_INTERPRET=1
(set before the first kernel import); that is how CPU parity tests exercise this backend.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata


class TritonAttentionBackend:
    """AttentionBackend over kernels.reshape_and_cache + kernels.unified_attention."""

    def __init__(self, num_splits: int | None = None) -> None:
        # None lets the kernel choose flash decoding per step; a CUDA-graph runner should fix it.
        self.num_splits = num_splits
        from kernels import reshape_and_cache, unified_attention

        self._reshape_and_cache = reshape_and_cache
        self._unified_attention = unified_attention

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
        self._reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return self._unified_attention(
            q,
            k_cache,
            v_cache,
            out,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            meta.max_query_len,
            meta.max_seq_len,
            num_splits=self.num_splits,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )

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
        return None  # on CUDA, decode steps replay captured graphs of forward
