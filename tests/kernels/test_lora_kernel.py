"""The batched LoRA term's Triton kernel against its plain-torch twin and against the engine's
CPU path: mixed adapters in one batch, rows of the base model, ranks below the slot width."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.reference import lora_shrink_expand_ref

pytest.importorskip("triton")

TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 1e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 5e-2, "rtol": 5e-2},
}


def _randn(*shape: int, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype).to(device)


def _slot_weights(
    ranks: list[int], columns: int, in_features: int, out_features: int, dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked slots where slot s uses only its first ranks[s] columns (the rest zero)."""
    a = torch.zeros(len(ranks) * columns, in_features)
    b_t = torch.zeros(len(ranks) * columns, out_features)
    for slot, rank in enumerate(ranks):
        first = slot * columns
        a[first : first + rank] = (
            _randn(rank, in_features, seed=slot, dtype=torch.float32, device="cpu") * 0.2
        )
        b_t[first : first + rank] = (
            _randn(rank, out_features, seed=50 + slot, dtype=torch.float32, device="cpu") * 0.2
        )
    return a.to(dtype).to(device), b_t.to(dtype).to(device)


def _segments(row_slots: list[int], device: torch.device):  # type: ignore[no-untyped-def]
    slots = np.asarray(row_slots)
    adapted = np.flatnonzero(slots >= 0)
    order = adapted[np.argsort(slots[adapted], kind="stable")]
    seg_slots, seg_starts, seg_lens = [], [], []
    for position, row in enumerate(order.tolist()):
        if not seg_slots or seg_slots[-1] != slots[row]:
            seg_slots.append(int(slots[row]))
            seg_starts.append(position)
            seg_lens.append(0)
        seg_lens[-1] += 1
    as_int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
    return (
        torch.from_numpy(order).to(device),
        as_int32(seg_slots),
        as_int32(seg_starts),
        as_int32(seg_lens),
        max(seg_lens, default=0),
    )


CASES = {
    # rows: each row's slot (-1: the base model); ranks: each slot's rank under a width of 8
    "decode, mixed": ([2, -1, 0, 2, 1, -1, 0], [8, 4, 2]),
    "prefill segments past one tile": ([1] * 20 + [-1] * 5 + [0] * 17 + [3] * 3, [8, 3, 8, 1]),
    "one row": ([0], [5]),
    "no adapted row": ([-1, -1, -1], [8]),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_the_reference(case: str, dtype: torch.dtype, device: torch.device) -> None:
    from kernels import lora_shrink_expand

    row_slots, ranks = CASES[case]
    columns, in_features, out_features = 8, 96, 80  # neither a multiple of the tiles
    a, b_t = _slot_weights(ranks, columns, in_features, out_features, dtype, device)
    x = _randn(len(row_slots), in_features, seed=7, dtype=dtype, device=device)
    base = _randn(len(row_slots), out_features, seed=8, dtype=dtype, device=device)
    segments = _segments(row_slots, device)
    expected = lora_shrink_expand_ref(x, a, b_t, base.clone(), *segments, columns)
    got = lora_shrink_expand(x, a, b_t, base.clone(), *segments, columns)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    untouched = [row for row, slot in enumerate(row_slots) if slot < 0]
    assert torch.equal(got[untouched], base[untouched])  # the base model's rows as they were
    if any(slot >= 0 for slot in row_slots):
        assert not torch.equal(got, base)


@pytest.mark.parametrize("parts", [1, 3])
def test_engine_layer_terms_through_the_kernel_equal_the_cpu_path(
    parts: int, device: torch.device
) -> None:
    """A layer's slots (a fused [q; k; v] one with parts=3) through the kernel, for all of a
    step's tokens and for its sampled rows, equal the slots' own torch computation."""
    from engine.lora.batched import LoRASlots, LoRAStep, StepSource
    from engine.lora.segmented import add_segmented

    max_rank, in_features, shard = 8, 64, 24
    out_features = shard * parts
    steps = StepSource()
    slots = LoRASlots(3, in_features, out_features, parts * max_rank, steps, device, torch.float32)
    for slot, rank in [(0, 8), (2, 3)]:  # slot 1 stays empty
        for part in range(parts):
            a = _randn(rank, in_features, seed=10 * slot + part, dtype=torch.float32, device=device)
            b = _randn(shard, rank, seed=99 - slot - part, dtype=torch.float32, device=device)
            rows = slice(part * shard, (part + 1) * shard)
            slots.write(slot, part * max_rank, rows, a * 0.3, b * 0.3)
    token_slots = np.array([0, 0, 0, -1, 2, 2, -1, 0, 2], dtype=np.int64)
    sample_rows = np.array([2, 3, 5, 8])
    steps.current = LoRAStep.of(token_slots, sample_rows, device, torch.float32)
    for rows in (len(token_slots), len(sample_rows)):
        x = _randn(rows, in_features, seed=rows, dtype=torch.float32, device=device)
        base = _randn(rows, out_features, seed=rows + 1, dtype=torch.float32, device=device)
        expected = slots.add_to(x, base.clone())
        got = add_segmented(slots, steps.current.for_rows(rows), x, base.clone())
        torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
