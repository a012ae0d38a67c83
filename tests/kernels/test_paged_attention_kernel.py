"""unified_attention (Triton) against its plain-torch twin, and the twin against dense SDPA."""

from __future__ import annotations

import pytest
import torch
from paged_cases import PagedBatch, dense_causal_attention, make_paged_batch

from kernels.reference import unified_attention_ref

TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}


def _run_kernel(batch: PagedBatch, scale: float, num_splits: int | None = None) -> torch.Tensor:
    pytest.importorskip("triton")
    from kernels import unified_attention

    out = torch.empty_like(batch.q)
    unified_attention(*batch.attention_args(out, scale), num_splits=num_splits)
    return out


def _run_reference(batch: PagedBatch, scale: float) -> torch.Tensor:
    out = torch.empty_like(batch.q)
    return unified_attention_ref(*batch.attention_args(out, scale))


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(actual).all(), "kernel read a slot outside some sequence's context"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "block_size"),
    [
        pytest.param([1], [1], 16, id="single-token-sequence"),
        pytest.param([1, 1], [32, 16], 16, id="decode-at-block-boundary"),
        pytest.param([32], [48], 16, id="prefill-chunk-ends-at-block-boundary"),
        pytest.param([20, 1, 17, 1, 1], [45, 1, 17, 33, 70], 16, id="mixed-prefill-and-decode"),
        pytest.param([70], [70], 16, id="long-prefill-many-query-blocks"),
        pytest.param([3, 1], [10, 200], 128, id="blocks-larger-than-a-tile"),
        pytest.param([5, 1], [29, 13], 8, id="small-blocks"),
    ],
)
def test_matches_reference_fp32(query_lens, seq_lens, block_size, device):
    batch = make_paged_batch(
        query_lens, seq_lens, num_q_heads=6, num_kv_heads=2, head_dim=64,
        block_size=block_size, dtype=torch.float32, device=device,
    )  # fmt: skip
    _assert_close(_run_kernel(batch, 0.125), _run_reference(batch, 0.125), torch.float32)


@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_ratios_and_head_dims(queries_per_kv, head_dim, device):
    num_kv_heads = 2
    batch = make_paged_batch(
        [9, 1, 1], [25, 16, 40], num_q_heads=num_kv_heads * queries_per_kv,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
        dtype=torch.float32, device=device, seed=queries_per_kv,
    )  # fmt: skip
    scale = head_dim**-0.5
    _assert_close(_run_kernel(batch, scale), _run_reference(batch, scale), torch.float32)


@pytest.mark.parametrize("head_dim", [8, 80])
def test_small_and_non_power_of_two_head_dims(head_dim, device):
    """Padded head dims: 8 (tiny test models) pads to the 16 tl.dot needs, 80 to 128."""
    batch = make_paged_batch(
        [6, 1], [20, 35], num_q_heads=4, num_kv_heads=2, head_dim=head_dim,
        block_size=16, dtype=torch.float32, device=device,
    )  # fmt: skip
    _assert_close(_run_kernel(batch, 0.3), _run_reference(batch, 0.3), torch.float32)


@pytest.mark.parametrize("queries_per_kv", [1, 3, 4])
def test_decode_batch_wider_than_a_query_block(queries_per_kv, device):
    """A decode-only batch of 20 sequences: more than one query block's worth of rows (16 // 3
    = 5 sequences with 3 query heads per KV head), each sequence in its own program."""
    rng = torch.Generator().manual_seed(queries_per_kv)
    seq_lens = torch.randint(1, 90, (20,), generator=rng).tolist()
    batch = make_paged_batch(
        [1] * 20, seq_lens, num_q_heads=2 * queries_per_kv, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=torch.float32, device=device, seed=queries_per_kv,
    )  # fmt: skip
    _assert_close(_run_kernel(batch, 0.125), _run_reference(batch, 0.125), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype, device):
    batch = make_paged_batch(
        [12, 1, 1], [30, 17, 64], num_q_heads=8, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=dtype, device=device,
    )  # fmt: skip
    _assert_close(_run_kernel(batch, 0.125), _run_reference(batch, 0.125), dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_split_kv_matches_single_pass(num_splits, device):
    """Flash decoding: up to 7 key tiles split 2/3/5 ways (some splits empty) merge exactly."""
    batch = make_paged_batch(
        [1, 1, 1], [200, 1, 97], num_q_heads=4, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=torch.float32, device=device,
    )  # fmt: skip
    single = _run_kernel(batch, 0.125, num_splits=1)
    split = _run_kernel(batch, 0.125, num_splits=num_splits)
    _assert_close(split, single, torch.float32)
    _assert_close(split, _run_reference(batch, 0.125), torch.float32)


def test_split_kv_on_mixed_batch(device):
    batch = make_paged_batch(
        [7, 1], [150, 100], num_q_heads=6, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=torch.float32, device=device,
    )  # fmt: skip
    _assert_close(_run_kernel(batch, 0.1, num_splits=2), _run_reference(batch, 0.1), torch.float32)


def test_heuristic_splits_long_decode_at_small_batch(device):
    pytest.importorskip("triton")
    from kernels import choose_num_splits

    assert choose_num_splits(1, 2, max_query_len=1, max_seq_len=4096, device=device) > 1
    assert choose_num_splits(1, 2, max_query_len=8, max_seq_len=4096, device=device) == 1
    assert choose_num_splits(1, 2, max_query_len=1, max_seq_len=64, device=device) == 1
    assert choose_num_splits(4096, 8, max_query_len=1, max_seq_len=4096, device=device) == 1

    batch = make_paged_batch(
        [1], [2500], num_q_heads=2, num_kv_heads=1, head_dim=64,
        block_size=16, dtype=torch.float32, device=device,
    )  # fmt: skip
    _assert_close(_run_kernel(batch, 0.125), _run_reference(batch, 0.125), torch.float32)


def test_padding_tokens_after_last_sequence_are_ignored(device):
    """CUDA-graph padding: q has rows past query_start_loc[-1]; real rows stay correct."""
    batch = make_paged_batch(
        [1, 1, 1], [5, 20, 33], num_q_heads=4, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=torch.float32, device=device,
    )  # fmt: skip
    expected = _run_reference(batch, 0.125)
    padding = torch.randn(5, *batch.q.shape[1:], device=device)
    batch.q = torch.cat([batch.q, padding])
    out = _run_kernel(batch, 0.125)
    _assert_close(out[:3], expected, torch.float32)


def test_reference_equals_dense_causal_sdpa(device):
    """The twin that defines the semantics agrees with SDPA over the unpaged K/V."""
    batch = make_paged_batch(
        [20, 1, 17, 4], [45, 16, 17, 33], num_q_heads=6, num_kv_heads=2, head_dim=32,
        block_size=16, dtype=torch.float32, device=device,
    )  # fmt: skip
    out = _run_reference(batch, 0.2)
    starts = batch.query_start_loc.tolist()
    for i in range(len(batch.query_lens)):
        q = batch.q[starts[i] : starts[i + 1]]
        expected = dense_causal_attention(q, batch.dense_k[i], batch.dense_v[i], 0.2)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, atol=1e-5, rtol=1e-5)


def test_every_prefill_tile_configuration_matches_reference(device):
    """The start-up measurement may pick any of the candidate launch configurations: each must
    compute the same attention, with 4 query heads packed per KV head and paged prefixes."""
    pytest.importorskip("triton")
    from kernels import prefill_tiles_for, unified_attention

    batch = make_paged_batch(
        [20, 1, 37], [45, 13, 100], num_q_heads=8, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=torch.float32, device=device,
    )  # fmt: skip
    expected = _run_reference(batch, 0.125)
    configurations = prefill_tiles_for(4, 64)
    assert len(configurations) >= 4
    for tiles in configurations:
        out = torch.empty_like(batch.q)
        unified_attention(*batch.attention_args(out, 0.125), prefill_tiles=tiles)
        _assert_close(out, expected, torch.float32)


def test_prefill_tiles_keep_narrow_key_tiles_for_wide_heads():
    pytest.importorskip("triton")
    from kernels import prefill_tiles_for

    wide = prefill_tiles_for(2, 256)
    assert wide and all(tiles.tile_n <= 32 for tiles in wide)
    # 16 query heads per KV head need 16 rows for one token: every candidate has them.
    assert prefill_tiles_for(16, 128) == prefill_tiles_for(1, 128)
