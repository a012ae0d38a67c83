"""The C++ LoRA term (kernels.cpu_ops.lora_add) against each row's x @ a[slot].T @ b_t[slot]."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops

pytestmark = pytest.mark.skipif(
    not cpu_ops.cpu_kernels_available(), reason="the C++ CPU kernels cannot be built here"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_each_adapted_row_gets_its_own_slots_term_and_the_others_keep_the_base(dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    slots, columns, in_features, width = 5, 24, 70, 530  # widths not multiples of any block
    a = torch.randn(slots, columns, in_features, generator=generator).to(dtype)
    b_t = torch.randn(slots, columns, width, generator=generator).to(dtype)
    a[2, 16:] = 0  # a slot whose adapter's rank is below the slots' width
    x = torch.randn(rows + 3, in_features, generator=generator).to(dtype)[3:]  # offset rows
    base = torch.randn(rows, width, generator=generator).to(dtype)
    row_slots = torch.randint(-1, slots, (rows,), generator=generator)  # -1: the base model
    adapted = torch.nonzero(row_slots >= 0).flatten()
    order = adapted[torch.argsort(row_slots[adapted], stable=True)]
    present, counts = torch.unique_consecutive(row_slots[order], return_counts=True)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])

    # Slot 1's columns are two parts of a fused layer: each reaches only its own outputs.
    spans = torch.tensor([0, width], dtype=torch.int64).repeat(slots, columns, 1)
    spans[1, : columns // 2] = torch.tensor([0, 200])
    spans[1, columns // 2 :] = torch.tensor([200, width])
    b_t[1, : columns // 2, 200:] = 0
    b_t[1, columns // 2 :, :200] = 0

    out = cpu_ops.lora_add(base.clone(), x, a, b_t, spans, order, present, starts)

    expected = base.double().clone()
    for row, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            expected[row] += x[row].double() @ a[slot].double().T @ b_t[slot].double()
    tolerance = (
        {"atol": 1e-3, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1, "rtol": 2e-2}
    )
    torch.testing.assert_close(out.double(), expected, **tolerance)
    untouched = row_slots < 0
    assert torch.equal(out[untouched], base[untouched])


@pytest.mark.parametrize("rows_per_slot", [1, 2, 3, 4, 5, 6, 9])
def test_fused_layer_terms_match_per_row_reference_at_every_tile_shape(rows_per_slot):
    """A fused [q; k; v]-like layer as the engine writes it (engine.lora.batched.LoRASlots):
    each shard's rank columns reach only that shard's outputs, a shard an adapter leaves alone
    and the columns past its rank are zero with empty spans. Row counts per slot cover every
    register tile the kernel picks, and the input and output widths leave vector tails."""
    generator = torch.Generator().manual_seed(rows_per_slot)
    slots, rank, max_rank, in_features = 4, 6, 8, 584 + 3
    shards = [(0, 264), (264, 328), (328, 392 + 5)]
    width, columns = shards[-1][1], max_rank * len(shards)
    a = torch.zeros(slots, columns, in_features)
    b_t = torch.zeros(slots, columns, width)
    spans = torch.zeros(slots, columns, 2, dtype=torch.int64)
    for slot in range(slots):
        for part, (lo, hi) in enumerate(shards):
            if (slot + part) % 3 == 2:  # this adapter leaves the shard alone
                continue
            cols = slice(part * max_rank, part * max_rank + rank)
            a[slot, cols] = torch.randn(rank, in_features, generator=generator)
            b_t[slot, cols, lo:hi] = torch.randn(rank, hi - lo, generator=generator)
            spans[slot, cols] = torch.tensor([lo, hi])
    row_slots = torch.arange(slots).repeat_interleave(rows_per_slot)
    row_slots = torch.cat([row_slots, torch.full((3,), -1)])  # and some rows of the base model
    row_slots = row_slots[torch.randperm(len(row_slots), generator=generator)]
    x = torch.randn(len(row_slots), in_features, generator=generator)
    base = torch.randn(len(row_slots), width, generator=generator)
    adapted = torch.nonzero(row_slots >= 0).flatten()
    order = adapted[torch.argsort(row_slots[adapted], stable=True)]
    present, counts = torch.unique_consecutive(row_slots[order], return_counts=True)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])

    out = cpu_ops.lora_add(base.clone(), x, a, b_t, spans, order, present, starts)

    expected = base.double().clone()
    for row, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            expected[row] += x[row].double() @ a[slot].double().T @ b_t[slot].double()
    torch.testing.assert_close(out.double(), expected, atol=1e-3, rtol=1e-4)
