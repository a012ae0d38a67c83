"""Prefill attention on CUDA: the measured choice between our Triton kernel's tile
configurations and torch's SDPA over the gathered paged context.

Measured once per GPU, torch/Triton version and attention shape (kept in the machine cache
beside the CPU measurements) over two typical prefill steps: a whole 2048-token prompt and a
1024-token chunk after 1024 cached tokens. Imported on CUDA only (Triton).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.prefill_select import (
    PrefillCandidate,
    PrefillChoice,
    Run,
    fastest,
    measure,
    wall_timer,
)
from engine.attention.torch_plan import PrefillShape
from engine.platforms.cpu.machine_cache import cached, machine_key
from kernels.paged_attention_tiles import PrefillTiles, prefill_tiles_for

logger = logging.getLogger(__name__)

KIND = "cuda_prefill_attention"
SDPA = "sdpa"
# (cached context, new tokens) of the sequences of the measured steps
STEPS = (((0, 2048),), ((1024, 1024),))


def choose_cuda_prefill(shape: PrefillShape) -> PrefillChoice:
    """The fastest path at `shape` on this GPU (measured now or read back). float32 keeps the
    kernel's defaults unmeasured: SDPA has no flash path for it, it is the dtype of checks
    rather than of serving, and each measurement compiles every tile configuration."""
    if shape.dtype == torch.float32:
        return PrefillChoice()
    device = torch.device("cuda", torch.cuda.current_device())
    key = machine_key(
        gpu=torch.cuda.get_device_name(device),
        triton=triton.__version__,
        dtype=str(shape.dtype).removeprefix("torch."),
        heads=shape.num_heads,
        kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        block_size=shape.block_size,
        steps=[[list(seq) for seq in step] for step in STEPS],
    )
    tiles = {_triton_name(t): t for t in _tiles(shape)}
    seconds = cached(KIND, key, lambda: _measure(shape, device, tiles), _read)
    name = fastest(seconds)
    if name == SDPA:
        return PrefillChoice(sdpa=True)
    return PrefillChoice(tiles=tiles.get(name or ""))


def _tiles(shape: PrefillShape) -> list[PrefillTiles]:
    return prefill_tiles_for(shape.num_heads // shape.num_kv_heads, shape.head_dim)


def _triton_name(tiles: PrefillTiles) -> str:
    return f"triton-{tiles.label}"


def _read(stored: object) -> dict[str, float]:
    if not isinstance(stored, dict):
        raise TypeError("not a table of timings")
    return {str(name): float(seconds) for name, seconds in stored.items()}


def _measure(
    shape: PrefillShape, device: torch.device, tiles: dict[str, PrefillTiles]
) -> dict[str, float]:
    """Each candidate through the backend itself, so the timing is the path steps take."""
    from engine.attention.triton_backend import TritonAttentionBackend

    def candidate(name: str, choice: PrefillChoice) -> PrefillCandidate:
        backend = TritonAttentionBackend(choose_prefill=lambda _: choice)

        def prepare() -> Run:
            cases = [_Case.make(shape, device, step) for step in STEPS]
            return lambda: [case.attend(backend, shape.head_dim**-0.5) for case in cases]

        return PrefillCandidate(name, prepare)

    candidates = [candidate(name, PrefillChoice(tiles=t)) for name, t in tiles.items()]
    candidates.append(candidate(SDPA, PrefillChoice(sdpa=True)))
    with torch.inference_mode():
        seconds = measure(candidates, wall_timer(torch.cuda.synchronize))
    torch.cuda.empty_cache()
    return seconds


@dataclass
class _Case:
    """One prefill step on random data: queries, a paged cache with shuffled blocks (the
    step's own K/V stored already: its slots are -1)."""

    q: torch.Tensor
    kv: torch.Tensor  # [T, Hkv, D] zeros, never stored
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata

    @classmethod
    def make(
        cls, shape: PrefillShape, device: torch.device, step: tuple[tuple[int, int], ...]
    ) -> _Case:
        bs = shape.block_size
        seq_lens = [context + new for context, new in step]
        query_lens = [new for _, new in step]
        blocks = [-(-n // bs) for n in seq_lens]
        order = torch.randperm(sum(blocks), device=device).to(torch.int32)
        width = max(blocks)
        tables = torch.zeros(len(step), width, dtype=torch.int32, device=device)
        start = 0
        for row, count in enumerate(blocks):
            tables[row, :count] = order[start : start + count]
            start += count
        cache_shape = (sum(blocks), bs, shape.num_kv_heads, shape.head_dim)
        k_cache = torch.randn(cache_shape, device=device).to(shape.dtype)
        v_cache = torch.randn(cache_shape, device=device).to(shape.dtype)
        tokens = sum(query_lens)
        q = torch.randn(tokens, shape.num_heads, shape.head_dim, device=device).to(shape.dtype)
        starts = torch.tensor([0, *query_lens], device=device).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device),
            query_start_loc=starts,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=tables,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        kv = torch.zeros(tokens, shape.num_kv_heads, shape.head_dim, device=device)
        return cls(q, kv.to(shape.dtype), k_cache, v_cache, meta)

    def attend(self, backend: AttentionBackend, scale: float) -> torch.Tensor:
        kv = self.kv
        return backend.forward(self.q, kv, kv, self.k_cache, self.v_cache, self.meta, scale)


def sdpa_paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its paged context through SDPA, one
    call per sequence: its K/V gathered from the cache (stored already), the queries aligned to
    the end of the context (bottom-right causal). q, out [T, Hq, D]; no window, soft-cap or
    sinks (the caller keeps those on the kernel)."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    start = 0
    for row, (q_len, seq_len) in enumerate(
        zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
    ):
        blocks = meta.block_tables[row, : -(-seq_len // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)  # [Hkv, S, D]
        v = v_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
        if group > 1:
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        query = q[start : start + q_len].transpose(0, 1)  # [Hq, L, D]
        mask = None
        if 1 < q_len < seq_len:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(q_len, seq_len)
        attended = F.scaled_dot_product_attention(
            query[None],
            k[None],
            v[None],
            attn_mask=mask,
            is_causal=q_len == seq_len and q_len > 1,
            scale=scale,
        )
        out[start : start + q_len] = attended[0].transpose(0, 1)
        start += q_len
    return out
