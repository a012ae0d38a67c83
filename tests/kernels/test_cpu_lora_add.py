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
