"""The plain-torch paged attention backend against a dense causal attention oracle.

Each case describes sequences by (cached context length, new query tokens); the cached part is
written into scattered cache blocks beforehand, the new K/V go in through the backend, and every
query token must match dense softmax attention over its causal context.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.torch_plan import PrefillShape
from engine.layers.rotary import RotaryEmbedding
from kernels.cpu_ops import cpu_kernels_available

HEAD_DIM = 16
NUM_BLOCKS = 64


@dataclass
class Case:
    contexts: list[int]  # tokens already in the cache, per sequence
    query_lens: list[int]  # new tokens this step, per sequence
    num_kv_heads: int = 2
    group: int = 1  # query heads per KV head
    block_size: int = 4
    skip_slots: tuple[int, ...] = ()  # flat token rows whose slot is -1
    head_dim: int = HEAD_DIM
    window: int | None = None  # sliding window: each query sees its last `window` positions


def _layout(case: Case, rng: random.Random) -> tuple[list[list[int]], list[int], AttentionMetadata]:
    """Scattered block tables, every new token's slot and the step's metadata for a case."""
    bs = case.block_size
    free_blocks = list(range(NUM_BLOCKS))
    rng.shuffle(free_blocks)  # non-contiguous, unordered block tables
    seq_lens = [c + n for c, n in zip(case.contexts, case.query_lens, strict=True)]
    tables = [[free_blocks.pop() for _ in range(-(-n // bs))] for n in seq_lens]

    slots, row = [], 0
    for context, n, table in zip(case.contexts, case.query_lens, tables, strict=True):
        for pos in range(context, context + n):
            slot = table[pos // bs] * bs + pos % bs
            slots.append(-1 if row in case.skip_slots else slot)
            row += 1

    max_blocks = max(len(t) for t in tables)
    block_tables = torch.zeros(len(tables), max_blocks, dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table)
    query_start = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start[1:] = torch.cumsum(torch.tensor(case.query_lens), 0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=query_start,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(case.query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(case.query_lens),
        seq_lens_cpu=seq_lens,
    )
    return tables, slots, meta


def _run_case(
    case: Case,
    seed: int = 0,
    paged_kernels: bool | None = None,
    dtype: torch.dtype = torch.float32,
    sdpa_prefill: bool = False,
):
    """Returns (backend output, oracle output, cache before, cache after, metadata)."""
    torch.manual_seed(seed)
    bs, hkv, num_heads = case.block_size, case.num_kv_heads, case.num_kv_heads * case.group
    k_cache = torch.randn(NUM_BLOCKS, bs, hkv, case.head_dim).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS, bs, hkv, case.head_dim).to(dtype)
    tables, slots, meta = _layout(case, random.Random(seed))
    total = sum(case.query_lens)
    q = torch.randn(total, num_heads, case.head_dim).to(dtype)
    k = torch.randn(total, hkv, case.head_dim).to(dtype)
    v = torch.randn(total, hkv, case.head_dim).to(dtype)
    before = (k_cache.clone(), v_cache.clone())
    scale = case.head_dim**-0.5
    backend = TorchAttentionBackend(paged_kernels, sdpa_prefill)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale, window=case.window)
    expected = _dense_oracle(q, k, v, before, tables, case, scale)
    return out, expected, before, (k_cache, v_cache), slots


def _dense_oracle(q, k, v, cache, tables, case: Case, scale: float) -> torch.Tensor:
    """Dense float64 attention; cached context read from the pre-step cache, new K/V from k, v."""
    bs = case.block_size
    out = torch.empty_like(q, dtype=torch.float64)
    row = 0
    for context, n, table in zip(case.contexts, case.query_lens, tables, strict=True):
        slots = [table[p // bs] * bs + p % bs for p in range(context)]
        keys = torch.cat([cache[0].reshape(-1, *k.shape[1:])[slots], k[row : row + n]])
        values = torch.cat([cache[1].reshape(-1, *v.shape[1:])[slots], v[row : row + n]])
        keys = keys.double().repeat_interleave(case.group, dim=1)  # [L, H, D]
        values = values.double().repeat_interleave(case.group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[row : row + n].double(), keys) * scale
        key_pos = torch.arange(context + n)[None, :]
        query_pos = torch.arange(context, context + n)[:, None]
        hidden = key_pos > query_pos
        if case.window is not None:
            hidden |= key_pos <= query_pos - case.window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[row : row + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        row += n
    return out.to(q.dtype)


CASES = {
    "single token, no context": Case(contexts=[0], query_lens=[1]),
    "decode at a block boundary": Case(contexts=[8, 3], query_lens=[1, 1]),
    "prefill ending at a block boundary": Case(contexts=[0], query_lens=[8]),
    "chunk after cached context": Case(contexts=[6], query_lens=[5]),
    "decodes of uneven lengths": Case(contexts=[0, 5, 12, 31], query_lens=[1, 1, 1, 1]),
    "mixed prefill chunks and decodes": Case(
        contexts=[9, 0, 4, 17, 0], query_lens=[1, 7, 6, 1, 1], block_size=8
    ),
    "gqa 3": Case(contexts=[3, 0, 10], query_lens=[1, 9, 4], num_kv_heads=2, group=3),
    "gqa 8": Case(contexts=[0, 21, 5], query_lens=[6, 1, 3], num_kv_heads=1, group=8),
    # head sizes the CPU decode kernel specialises at compile time
    "head_dim 64": Case(contexts=[0, 37, 70], query_lens=[1, 1, 1], group=3, head_dim=64),
    "head_dim 128": Case(contexts=[12, 3], query_lens=[1, 5], head_dim=128, block_size=16),
    # decode batches in the AVX-512 kernel: tokens in fours and a tail, more query heads per KV
    # head than it keeps in registers at once
    "decode batch, head_dim 64, gqa 8": Case(
        contexts=[0, 3, 4, 15, 16, 17, 33, 63, 100],
        query_lens=[1] * 9,
        num_kv_heads=2,
        group=8,
        head_dim=64,
        block_size=16,
    ),
    "decode batch, head_dim 128, gqa 3": Case(
        contexts=[1, 7, 16, 29, 50], query_lens=[1] * 5, group=3, head_dim=128, block_size=16
    ),
    # the CPU prefill kernel works in tiles of 64 // group queries
    "prefill chunks over several tiles": Case(
        contexts=[0, 40, 3], query_lens=[150, 70, 1], group=3, head_dim=64, block_size=16
    ),
    "one head per kv head, long chunk": Case(contexts=[5], query_lens=[130], group=1),
    "head_dim 6": Case(contexts=[2, 0], query_lens=[9, 4], head_dim=6),
    # sliding windows shorter than the contexts, not aligned to blocks
    "window: decodes": Case(contexts=[0, 5, 12, 31, 7], query_lens=[1] * 5, window=6),
    "window: prefill from scratch": Case(contexts=[0], query_lens=[37], window=5, group=3),
    "window: chunks and decodes": Case(
        contexts=[9, 0, 40, 17, 3], query_lens=[1, 30, 11, 1, 1], block_size=8, window=11
    ),
    "window: head_dim 64 tiles": Case(
        contexts=[0, 40], query_lens=[150, 70], group=3, head_dim=64, block_size=16, window=24
    ),
}


PATHS = {
    "gather": (False, False),
    "cpu kernel": (None, False),
    "kernel + sdpa prefill": (None, True),
}


@pytest.mark.parametrize(("paged_kernels", "sdpa_prefill"), PATHS.values(), ids=PATHS.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_dense_attention(
    case: Case, paged_kernels: bool | None, sdpa_prefill: bool
) -> None:
    out, expected, *_ = _run_case(case, paged_kernels=paged_kernels, sdpa_prefill=sdpa_prefill)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_cpu_attention_kernels_build_here() -> None:
    # Attention takes the gather path silently when the kernels are missing; CI must notice.
    assert cpu_kernels_available()


@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 128])
@pytest.mark.parametrize("paged_kernels", [False, None], ids=["gather", "cpu kernel"])
def test_bfloat16_decodes_match_the_oracle(paged_kernels: bool | None, head_dim: int) -> None:
    case = Case(
        contexts=[0, 5, 40, 31, 17],
        query_lens=[1] * 5,
        num_kv_heads=3,
        group=3,
        head_dim=head_dim,
        block_size=16,
    )
    out, expected, *_ = _run_case(case, paged_kernels=paged_kernels, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("paged_kernels", "sdpa_prefill"), PATHS.values(), ids=PATHS.keys())
def test_bfloat16_prefill_chunks_match_the_oracle(
    paged_kernels: bool | None, sdpa_prefill: bool
) -> None:
    case = Case(contexts=[0, 37, 4], query_lens=[90, 30, 1], num_kv_heads=3, group=3)
    out, expected, *_ = _run_case(
        case, paged_kernels=paged_kernels, dtype=torch.bfloat16, sdpa_prefill=sdpa_prefill
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_new_kv_lands_in_its_slots(case: Case) -> None:
    _, _, before, after, slots = _run_case(case)
    for cache_before, cache_after in zip(before, after, strict=True):
        flat_before = cache_before.reshape(-1, *cache_before.shape[2:])
        flat_after = cache_after.reshape(-1, *cache_after.shape[2:])
        untouched = torch.ones(flat_before.shape[0], dtype=torch.bool)
        untouched[[s for s in slots if s >= 0]] = False
        assert torch.equal(flat_after[untouched], flat_before[untouched])
        assert not torch.equal(flat_after[~untouched], flat_before[~untouched])


def test_skipped_slots_leave_the_cache_unchanged() -> None:
    case = Case(contexts=[4, 0, 7], query_lens=[1, 3, 1], skip_slots=(0, 4))
    out, expected, before, after, slots = _run_case(case)
    assert slots[0] == -1 and slots[4] == -1
    for cache_before, cache_after in zip(before, after, strict=True):
        flat_before = cache_before.reshape(-1, *cache_before.shape[2:])
        flat_after = cache_after.reshape(-1, *cache_after.shape[2:])
        written = [s for s in slots if s >= 0]
        unwritten = torch.ones(flat_before.shape[0], dtype=torch.bool)
        unwritten[written] = False
        assert torch.equal(flat_after[unwritten], flat_before[unwritten])
    # The sequence that wrote normally still attends correctly.
    torch.testing.assert_close(out[1:4], expected[1:4], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sdpa_prefill", [False, True], ids=["kernel prefill", "sdpa prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_step_from_the_fused_projection_matches_rotating_then_attending(
    case: Case, dtype: torch.dtype, sdpa_prefill: bool
) -> None:
    # Every CPU step with the kernels rotates and stores in one kernel call (attend_from_qkv);
    # it must give what the portable path gives: rotate q and k, then forward.
    torch.manual_seed(0)
    bs, hkv, num_heads = case.block_size, case.num_kv_heads, case.num_kv_heads * case.group
    caches = [torch.randn(NUM_BLOCKS, bs, hkv, case.head_dim).to(dtype) for _ in range(2)]
    qkv = torch.randn(sum(case.query_lens), (num_heads + 2 * hkv) * case.head_dim).to(dtype)
    positions = torch.tensor(
        [p for c, n in zip(case.contexts, case.query_lens, strict=True) for p in range(c, c + n)]
    )
    rotary = RotaryEmbedding(case.head_dim, 512, 10000.0, None)
    scale = case.head_dim**-0.5

    fused_caches = [c.clone() for c in caches]
    _, _, meta = _layout(case, random.Random(0))
    fused = TorchAttentionBackend(sdpa_prefill=sdpa_prefill).attend_from_qkv(
        qkv, positions, rotary.cos_sin_cache, num_heads, *fused_caches, meta, scale
    )
    assert fused is not None

    _, _, meta = _layout(case, random.Random(0))
    q, k, v = qkv.split([num_heads * case.head_dim, hkv * case.head_dim, hkv * case.head_dim], -1)
    q, k = rotary(positions, q, k)
    v = v.reshape(-1, hkv, case.head_dim)
    expected = TorchAttentionBackend().forward(q, k, v, *caches, meta, scale)

    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused, expected, atol=tolerance, rtol=tolerance)
    for fused_cache, cache in zip(fused_caches, caches, strict=True):
        torch.testing.assert_close(fused_cache, cache, atol=tolerance, rtol=tolerance)


def test_without_the_kernels_a_step_from_the_fused_projection_is_declined() -> None:
    case = CASES["mixed prefill chunks and decodes"]
    hkv, num_heads = case.num_kv_heads, case.num_kv_heads * case.group
    k_cache, v_cache = (torch.zeros(NUM_BLOCKS, case.block_size, hkv, HEAD_DIM) for _ in "kv")
    qkv = torch.randn(sum(case.query_lens), (num_heads + 2 * hkv) * HEAD_DIM)
    positions = torch.zeros(qkv.shape[0], dtype=torch.int64)
    rotary = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None)
    _, _, meta = _layout(case, random.Random(0))
    out = TorchAttentionBackend(paged_kernels=False).attend_from_qkv(
        qkv, positions, rotary.cos_sin_cache, num_heads, k_cache, v_cache, meta, 1.0
    )
    assert out is None
    assert not k_cache.any()  # nothing stored: the caller's forward will store


def test_the_prefill_path_is_measured_once_per_machine_and_shape(monkeypatch, tmp_path) -> None:
    from engine.platforms.cpu import prefill_choice

    monkeypatch.setenv("INFERQ_HOME", str(tmp_path / "home"))
    shape = PrefillShape(torch.bfloat16, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16)
    first = prefill_choice.sdpa_prefill_wins(shape)
    stored = list((tmp_path / "home").rglob("*.json"))
    assert len(stored) == 1 and prefill_choice.KIND in str(stored[0])

    def measure_again(shape: PrefillShape) -> dict[str, float]:
        raise AssertionError("measured again")

    monkeypatch.setattr(prefill_choice, "_measure", measure_again)
    assert prefill_choice.sdpa_prefill_wins(shape) == first


@pytest.mark.parametrize("sdpa_wins", [False, True])
def test_a_backend_asks_once_per_shape_and_attends_through_the_chosen_path(sdpa_wins) -> None:
    asked = []

    def choose(shape: PrefillShape) -> bool:
        asked.append(shape)
        return sdpa_wins

    backend = TorchAttentionBackend(sdpa_prefill=choose)
    case = Case(contexts=[0, 37, 4], query_lens=[90, 30, 1], group=3, head_dim=64, block_size=16)
    for seed in range(2):
        torch.manual_seed(seed)
        bs, hkv, num_heads = case.block_size, case.num_kv_heads, case.num_kv_heads * case.group
        k_cache = torch.randn(NUM_BLOCKS, bs, hkv, case.head_dim)
        v_cache = torch.randn(NUM_BLOCKS, bs, hkv, case.head_dim)
        tables, _, meta = _layout(case, random.Random(seed))
        total = sum(case.query_lens)
        q = torch.randn(total, num_heads, case.head_dim)
        k, v = torch.randn(2, total, hkv, case.head_dim)
        before = (k_cache.clone(), v_cache.clone())
        out = backend.forward(q, k, v, k_cache, v_cache, meta, case.head_dim**-0.5)
        assert (meta.backend_plan.paged_prefill is None) == sdpa_wins
        expected = _dense_oracle(q, k, v, before, tables, case, case.head_dim**-0.5)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert asked == [PrefillShape(torch.float32, 6, 2, 64, 16)]
