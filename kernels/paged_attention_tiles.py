"""Launch configurations of the unified paged attention kernel (kernels.paged_attention): the
tile shape of a step (query rows, key tiles, warps, pipeline depth), the candidates a start-up
measurement picks the prefill tiles from, and how many context splits a decode batch wants."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels._launch import next_pow2, num_compute_units

# Shorter contexts finish so fast in one pass that the extra merge launch would cost more.
_SPLIT_MIN_SEQ_LEN = 1024
# Each split should still stream at least this many keys to amortise its partial write.
_SPLIT_MIN_KEYS = 256
_MAX_SPLITS = 64


@dataclass(frozen=True)
class _LaunchShape:
    block_m: int
    block_q: int
    tile_n: int
    num_warps: int
    num_stages: int | None = None  # None: Triton's default pipelining depth


@dataclass(frozen=True)
class PrefillTiles:
    """A launch configuration for steps with prefill chunks: BLOCK_M rows (query tokens times
    the query heads of one KV head), TILE_N keys per tile, warps per program and the depth of
    the K/V load pipeline."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int

    @property
    def label(self) -> str:
        return f"m{self.block_m}n{self.tile_n}w{self.num_warps}s{self.num_stages}"


# The candidates a start-up measurement picks from on Hopper-class GPUs: 128-row tiles feed
# the tensor cores with a whole warpgroup's worth of rows; 2-4 stages overlap the gathered K/V
# loads with the dots. Wide heads (D > 128) keep the narrower key tiles that do not spill.
PREFILL_TILES = (
    PrefillTiles(128, 64, 8, 3),
    PrefillTiles(128, 64, 8, 2),
    PrefillTiles(128, 64, 4, 2),
    PrefillTiles(128, 32, 4, 4),
    PrefillTiles(64, 64, 4, 3),
    PrefillTiles(64, 64, 8, 4),
)


def prefill_tiles_for(queries_per_kv: int, head_dim: int) -> list[PrefillTiles]:
    """The candidates that fit a head layout: BLOCK_M holds at least one token's heads."""
    wide = padded_head_dim(head_dim) > 128
    return [
        tiles
        for tiles in PREFILL_TILES
        if tiles.block_m >= next_pow2(queries_per_kv) and not (wide and tiles.tile_n > 32)
    ]


def padded_head_dim(head_dim: int) -> int:
    """The power of two the kernel tiles the head dim to; tl.dot needs at least 16."""
    return max(16, next_pow2(head_dim))


def _launch_shape(
    queries_per_kv: int,
    max_query_len: int,
    head_dim_pad: int,
    prefill_tiles: PrefillTiles | None = None,
) -> _LaunchShape:
    """Tile sizes: 16 query rows (tl.dot's minimum) for decodes, 64 for prefill chunks unless
    `prefill_tiles` (a measured choice) says otherwise.

    Picked so that sm_90 compiles spill no registers (checked with ptxas -v): the gathered K/V
    addresses are register-hungry, so wide heads get narrower key tiles.
    """
    wide = head_dim_pad > 128
    num_stages = None
    if max_query_len <= 1:
        block_m, tile_n, num_warps = 16, 16 if wide else 32, 4
    elif prefill_tiles is not None:
        block_m, tile_n = prefill_tiles.block_m, prefill_tiles.tile_n
        num_warps, num_stages = prefill_tiles.num_warps, prefill_tiles.num_stages
    else:
        block_m, tile_n, num_warps = (32, 16, 8) if wide else (64, 64, 8)
    block_m = max(block_m, next_pow2(queries_per_kv))
    return _LaunchShape(block_m, block_m // queries_per_kv, tile_n, num_warps, num_stages)


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    device: torch.device,
) -> int:
    """How many context splits a decode-only batch wants: enough programs to fill the GPU.

    Splitting only pays off when few (sequence, KV head) pairs meet a long context; otherwise
    the single pass already occupies every SM and the merge would be pure overhead.
    """
    if max_query_len != 1 or max_seq_len < _SPLIT_MIN_SEQ_LEN:
        return 1
    programs = num_seqs * num_kv_heads
    target = 2 * num_compute_units(device)
    if programs >= target:
        return 1
    splits = min(math.ceil(target / programs), max_seq_len // _SPLIT_MIN_KEYS, _MAX_SPLITS)
    return max(splits, 1)
