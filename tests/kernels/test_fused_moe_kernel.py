"""The fused-MoE Triton kernel against its plain-torch twin and the CPU grouped GEMMs."""

from __future__ import annotations

import pytest
import torch

from engine.layers.moe.compute import grouped_experts, plain_gemms
from engine.layers.moe.routing import RouterSpec, Scoring, route
from kernels.reference import fused_moe_ref

pytest.importorskip("triton")

TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


def _case(tokens: int, experts: int, top_k: int, dtype: torch.dtype, device: torch.device):
    g = torch.Generator().manual_seed(tokens * 31 + experts)
    hidden, inter = 48, 40  # neither a power of two: the kernel masks its tiles
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = route(logits, RouterSpec(experts, top_k, Scoring.SOFTMAX_TOPK, True))
    return [t.to(device) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"), [(0, 4, 2), (1, 8, 2), (5, 4, 4), (37, 8, 3)]
)
def test_fused_moe_matches_the_reference(tokens, experts, top_k, dtype, device) -> None:
    from kernels import fused_moe

    x, w13, w2, weights, ids = _case(tokens, experts, top_k, dtype, device)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), **TOLERANCE[dtype])


def test_grouped_cpu_experts_match_the_reference() -> None:
    x, w13, w2, weights, ids = _case(37, 8, 3, torch.float32, torch.device("cpu"))
    out = grouped_experts(x, weights, ids, 8, *plain_gemms(w13, w2))
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
