"""The paged KV cache: one tensor for all layers, sized by a block count or a memory budget.

Layout [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim], so each layer's
k_cache / v_cache is a contiguous [num_blocks, block_size, num_kv_heads, head_dim] view. The
cache is uniform: every layer of the model has the same KV shape.

Multi-head latent attention layers (DeepSeek) cache one compressed row per token instead: the
layout is then [num_layers, 1, num_blocks, block_size, 1, latent_size] and a layer's k_cache
and v_cache are the same view (AttentionSpec.cache_row), so a block costs latent_size features
per layer and token, not 2 * num_kv_heads * head_dim.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.models.interface import CausalLM


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    planes: int = 2  # k and v; 1 for a latent cache whose k and v views are one tensor

    @classmethod
    def for_model(cls, model: CausalLM, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """The spec of a cache for every layer of model (its KV shapes as this rank holds them)."""
        shapes = {spec.cache_row for spec in model.attention_specs()}
        if len(shapes) != 1:
            raise NotImplementedError(
                f"layers of different KV shapes (planes, heads, head_dim): {sorted(shapes)}; "
                "the paged KV cache holds one shape for all layers"
            )
        ((planes, num_kv_heads, head_dim),) = shapes
        return cls(len(model.decoder_layers), num_kv_heads, head_dim, block_size, dtype, planes)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, keys and values (or latent rows)."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        features = self.planes * self.num_kv_heads * self.head_dim
        return self.num_layers * self.block_size * features * element_size


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int) -> int:
    """How many whole blocks fit in budget_bytes."""
    return max(0, budget_bytes // spec.bytes_per_block)


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block (got {num_blocks})")
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (
            spec.num_layers,
            spec.planes,
            num_blocks,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_dim,
        )
        # Zeroed, not empty: attention reads padding slots under a mask, and 0 * NaN garbage
        # would still poison the output.
        self.tensor = _zeros(shape, spec.dtype, torch.device(device))
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.tensor[i, 0], self.tensor[i, spec.planes - 1]) for i in range(spec.num_layers)
        ]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of forked sequences)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.tensor.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=self.tensor.device)
        # The source blocks are gathered before any write, so chains (a->b, b->c) read old data.
        self.tensor.index_copy_(2, dst, self.tensor.index_select(2, src))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return _zero_pages(nbytes).view(dtype).view(shape)


_HUGE_PAGE = 2 << 20


def _zero_pages(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of private anonymous memory, on transparent huge pages where the kernel
    allows them (THP "madvise" mode, the common default, needs this request).

    Its pages are zero pages mapped on first touch: a multi-GB cache costs nothing until its
    blocks are used, where torch.zeros would write every page up front (seconds). A decode
    step reads KV blocks scattered over the cache, and on 4 KiB pages nearly every block costs
    TLB misses; torch's allocator asks for huge pages for the tensors it makes, not for these."""
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the region
    start = -whole.data_ptr() % _HUGE_PAGE  # huge pages need 2 MiB-aligned addresses
    return whole[start : start + nbytes]
