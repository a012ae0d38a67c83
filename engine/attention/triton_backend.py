"""Attention through the Triton kernels: one KV-cache write plus one unified attention launch.

Triton is imported when the backend is constructed, not with this module, so CPU-only
installs can import the engine. On CPU tensors the kernels run only under TRITON_INTERPRET=1
(set before the first kernel import); that is how CPU parity tests exercise this backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.prefill_select import PrefillChoice
from engine.attention.torch_plan import PrefillShape

logger = logging.getLogger(__name__)

# Per-sequence SDPA calls cost a launch or more each: steps of many sequences keep the kernel.
SDPA_MAX_SEQS = 16


class TritonAttentionBackend:
    """AttentionBackend over kernels.reshape_and_cache + kernels.unified_attention."""

    def __init__(
        self,
        num_splits: int | None = None,
        choose_prefill: Callable[[PrefillShape], PrefillChoice] | None = None,
    ) -> None:
        """choose_prefill: how steps with prefill chunks attend at a shape, asked once per
        shape (a measurement on CUDA); None: the kernel with its default tiles."""
        # None lets the kernel choose flash decoding per step; a CUDA-graph runner should fix it.
        self.num_splits = num_splits
        from engine.attention.cuda_prefill import sdpa_paged_prefill
        from kernels import reshape_and_cache, unified_attention

        self._reshape_and_cache = reshape_and_cache
        self._unified_attention = unified_attention
        self._sdpa_paged_prefill = sdpa_paged_prefill
        self._choose_prefill = choose_prefill
        self._prefill: dict[PrefillShape, PrefillChoice] = {}

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
        choice = PrefillChoice()
        if meta.max_query_len > 1:
            shape = PrefillShape(q.dtype, q.shape[1], *k_cache.shape[2:], k_cache.shape[1])
            choice = self._prefill_choice(shape)
            plain = window is None and softcap is None and sinks is None
            if choice.sdpa and plain and meta.num_seqs <= SDPA_MAX_SEQS:
                try:
                    return self._sdpa_paged_prefill(q, k_cache, v_cache, out, meta, scale)
                except RuntimeError:
                    logger.exception("SDPA prefill failed; steps with prefills use the kernel")
                    choice = self._prefill[shape] = PrefillChoice()
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
            prefill_tiles=choice.tiles,
        )

    def _prefill_choice(self, shape: PrefillShape) -> PrefillChoice:
        choice = self._prefill.get(shape)
        if choice is None:
            ask = self._choose_prefill
            choice = PrefillChoice() if ask is None else ask(shape)
            self._prefill[shape] = choice
        return choice

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
