"""Sliding-window attention in every paged kernel (the CPU C++ decode and prefill kernels and
the Triton kernel, interpreted on the CPU) against dense attention restricted to each query's
window, with and without soft-capped scores (Gemma 2) and attention sinks (gpt-oss).

The blocks wholly before every query's window are pointed at a NaN block, as a freed block
would be: a kernel that reads them poisons its output.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import PagedBatch, make_paged_batch

from kernels.cpu_ops import cpu_kernels_available, paged_decode_attention, paged_prefill_attention
from kernels.reference import unified_attention_ref

SCALE = 0.125
TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}

# (query_lens, seq_lens, block_size, window)
CASES = {
    "decodes-past-the-window": ([1, 1, 1], [40, 9, 77], 4, 8),
    "decode-window-not-block-aligned": ([1, 1], [53, 21], 16, 13),
    "decode-shorter-than-window": ([1, 1], [5, 40], 4, 16),
    "prefill-from-scratch": ([45], [45], 4, 8),
    "chunk-over-cached-context": ([11, 1], [50, 30], 4, 7),
    "mixed-chunks-and-decodes": ([20, 1, 17, 1], [45, 33, 17, 70], 8, 12),
    "long-chunk-many-tiles": ([90], [130], 16, 16),
}


def _windowed_oracle(
    batch: PagedBatch,
    window: int,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense attention of each sequence's queries over its keys, each query seeing the last
    `window` positions up to its own (scores soft-capped by softcap; each head's sink logit
    one more softmax term with no value)."""
    outs = []
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        q = batch.q[starts[i] : starts[i + 1]].float()
        k, v = batch.dense_k[i].float(), batch.dense_v[i].float()
        group = q.shape[1] // k.shape[1]
        q_pos = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(group, 1))
        scores = scores * SCALE
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.double().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            scores = torch.cat((scores, sink), dim=-1)
        probs = scores.softmax(-1)[..., : k.shape[0]]
        out = torch.einsum("hqk,khd->qhd", probs, v.double().repeat_interleave(group, 1))
        outs.append(out.float().cpu())
    return torch.cat(outs)


def _batch(case: str, dtype: torch.dtype, device: torch.device, group: int = 3) -> PagedBatch:
    """The case's batch, with every block wholly before its sequence's first query's window
    pointed at a NaN block."""
    query_lens, seq_lens, block_size, window = CASES[case]
    batch = make_paged_batch(
        query_lens, seq_lens, num_q_heads=2 * group, num_kv_heads=2, head_dim=64,
        block_size=block_size, dtype=dtype, device=device, spare_blocks=1,
    )  # fmt: skip
    used = set(batch.block_tables.flatten().tolist())
    nan_block = next(b for b in range(batch.k_cache.shape[0]) if b not in used)
    assert torch.isnan(batch.k_cache[nan_block].float()).all()
    for i, (n, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        first_key = max(0, seq_len - n - window + 1)
        batch.block_tables[i, : first_key // block_size] = nan_block
    return batch


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(actual).all(), "a kernel read a block outside every window"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


def _cpu_kernels(
    batch: PagedBatch,
    window: int,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode rows through paged_decode_attention, chunks through paged_prefill_attention."""
    out = torch.empty_like(batch.q)
    starts = batch.query_start_loc.tolist()
    decodes = [i for i, n in enumerate(batch.query_lens) if n == 1]
    chunks = [i for i, n in enumerate(batch.query_lens) if n > 1]
    if decodes:
        rows = torch.tensor([starts[i] for i in decodes])
        index = torch.tensor(decodes)
        decode_out = torch.empty_like(batch.q[rows])
        paged_decode_attention(
            decode_out,
            batch.q[rows].contiguous(),
            batch.k_cache,
            batch.v_cache,
            batch.block_tables[index].contiguous(),
            batch.seq_lens[index].contiguous(),
            SCALE,
            window,
            softcap,
            sinks,
        )
        out[rows] = decode_out
    if chunks:
        index = torch.tensor(chunks)
        paged_prefill_attention(
            out,
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables[index].contiguous(),
            batch.query_start_loc[index].contiguous(),
            torch.tensor([batch.query_lens[i] for i in chunks], dtype=torch.int32),
            batch.seq_lens[index].contiguous(),
            SCALE,
            window,
            softcap,
            sinks,
        )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_cpu_kernels_attend_within_the_window(case: str, dtype: torch.dtype) -> None:
    if not cpu_kernels_available():
        pytest.skip("the CPU kernels cannot be built here")
    batch = _batch(case, dtype, torch.device("cpu"))
    window = CASES[case][3]
    _assert_close(_cpu_kernels(batch, window), _windowed_oracle(batch, window), dtype)


@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_attends_within_the_window(case: str, device: torch.device) -> None:
    pytest.importorskip("triton")
    from kernels import unified_attention

    batch = _batch(case, torch.float32, device)
    window = CASES[case][3]
    out = torch.empty_like(batch.q)
    unified_attention(*batch.attention_args(out, SCALE), window=window)
    _assert_close(out.cpu(), _windowed_oracle(batch, window), torch.float32)


def test_triton_flash_decoding_splits_respect_the_window(device: torch.device) -> None:
    pytest.importorskip("triton")
    from kernels import unified_attention

    batch = _batch("decodes-past-the-window", torch.float32, device)
    out = torch.empty_like(batch.q)
    unified_attention(*batch.attention_args(out, SCALE), num_splits=3, window=8)
    _assert_close(out.cpu(), _windowed_oracle(batch, 8), torch.float32)


@pytest.mark.parametrize("case", CASES)
def test_reference_twin_attends_within_the_window(case: str) -> None:
    batch = _batch(case, torch.float32, torch.device("cpu"))
    window = CASES[case][3]
    out = torch.empty_like(batch.q)
    unified_attention_ref(*batch.attention_args(out, SCALE), window=window)
    _assert_close(out, _windowed_oracle(batch, window), torch.float32)


# Scores of these random inputs spread over about +-4: a cap of 2 bends most of them.
SOFTCAP = 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["decodes-past-the-window", "mixed-chunks-and-decodes"])
def test_cpu_kernels_cap_scores(case: str, dtype: torch.dtype) -> None:
    if not cpu_kernels_available():
        pytest.skip("the CPU kernels cannot be built here")
    batch = _batch(case, dtype, torch.device("cpu"))
    window = CASES[case][3]
    expected = _windowed_oracle(batch, window, SOFTCAP)
    _assert_close(_cpu_kernels(batch, window, SOFTCAP), expected, dtype)
    assert not torch.allclose(_windowed_oracle(batch, window), expected, atol=1e-2)


@pytest.mark.parametrize("case", ["decodes-past-the-window", "mixed-chunks-and-decodes"])
def test_triton_kernel_caps_scores(case: str, device: torch.device) -> None:
    pytest.importorskip("triton")
    from kernels import unified_attention

    batch = _batch(case, torch.float32, device)
    window = CASES[case][3]
    out = torch.empty_like(batch.q)
    unified_attention(*batch.attention_args(out, SCALE), window=window, softcap=SOFTCAP)
    _assert_close(out.cpu(), _windowed_oracle(batch, window, SOFTCAP), torch.float32)
    ref = torch.empty_like(batch.q)
    unified_attention_ref(*batch.attention_args(ref, SCALE), window=window, softcap=SOFTCAP)
    _assert_close(ref, _windowed_oracle(batch, window, SOFTCAP), torch.float32)


def _sinks(heads: int = 6) -> torch.Tensor:
    """Sink logits from well below to well above the scores (about +-4 here), so that some
    heads barely notice their sink and some give it most of the weight."""
    return torch.linspace(-3.0, 6.0, heads)


SINK_CASES = ["decodes-past-the-window", "mixed-chunks-and-decodes", "long-chunk-many-tiles"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", SINK_CASES)
def test_cpu_kernels_count_attention_sinks(case: str, dtype: torch.dtype) -> None:
    if not cpu_kernels_available():
        pytest.skip("the CPU kernels cannot be built here")
    batch = _batch(case, dtype, torch.device("cpu"))
    window = CASES[case][3]
    expected = _windowed_oracle(batch, window, sinks=_sinks())
    _assert_close(_cpu_kernels(batch, window, sinks=_sinks()), expected, dtype)
    assert not torch.allclose(_windowed_oracle(batch, window), expected, atol=1e-2)


def test_cpu_kernels_count_sinks_at_any_head_size() -> None:
    """A head size the kernels do not specialise (the portable decode path)."""
    if not cpu_kernels_available():
        pytest.skip("the CPU kernels cannot be built here")
    query_lens, seq_lens, block_size, window = CASES["mixed-chunks-and-decodes"]
    batch = make_paged_batch(
        query_lens, seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=24,
        block_size=block_size, dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    sinks = _sinks(4)
    expected = _windowed_oracle(batch, window, SOFTCAP, sinks)
    _assert_close(_cpu_kernels(batch, window, SOFTCAP, sinks), expected, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", ["decodes-past-the-window", "mixed-chunks-and-decodes"])
def test_triton_kernel_counts_attention_sinks(
    case: str, num_splits: int, device: torch.device
) -> None:
    pytest.importorskip("triton")
    from kernels import unified_attention

    batch = _batch(case, torch.float32, device)
    window = CASES[case][3]
    splits = num_splits if max(batch.query_lens) == 1 else 1
    out = torch.empty_like(batch.q)
    sinks = _sinks().to(device)
    unified_attention(
        *batch.attention_args(out, SCALE), num_splits=splits, window=window, sinks=sinks
    )
    expected = _windowed_oracle(batch, window, sinks=_sinks())
    _assert_close(out.cpu(), expected, torch.float32)
    ref = torch.empty_like(batch.q)
    unified_attention_ref(*batch.attention_args(ref, SCALE), window=window, sinks=_sinks())
    _assert_close(ref, expected, torch.float32)
