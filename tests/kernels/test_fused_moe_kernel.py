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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_with_biases_the_transposed_layout_and_gpt_oss_activation(
    dtype: torch.dtype, device: torch.device
) -> None:
    """gpt-oss's experts: weights in the checkpoint's [E, H, 2I] / [E, I, H] layout read through
    transposed views, bias rows on both projections, the clamped SwiGLU over interleaved gate
    and up columns; the kernels (on CUDA) and the grouped CPU GEMMs give the reference's sum."""
    from engine.layers.moe.biased import BiasedExperts, clamped_swiglu
    from kernels import fused_moe

    tokens, experts, top_k, hidden, inter = 29, 6, 2, 48, 40
    g = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=g)
    module = BiasedExperts(experts, hidden, inter, alpha=1.702, limit=1.5)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=g) / param.shape[-2] ** 0.5)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = route(logits, RouterSpec(experts, top_k, Scoring.TOPK_SOFTMAX))

    def activation(gate_up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate_up, 1.702, 1.5)

    w13, w2 = module.gate_up_proj.transpose(1, 2), module.down_proj.transpose(1, 2)
    b13, b2 = module.gate_up_proj_bias, module.down_proj_bias
    expected = fused_moe_ref(x, w13, w2, weights, ids, b13, b2, activation)
    assert not torch.allclose(expected, fused_moe_ref(x, w13, w2, weights, ids, b13, b2))
    torch.testing.assert_close(module(x, weights, ids), expected, atol=1e-5, rtol=1e-5)

    moved = [t.to(device=device, dtype=dtype) for t in (x, w13, w2, b13, b2)]
    out = fused_moe(
        moved[0], moved[1], moved[2], weights.to(device), ids.to(device), *moved[3:], activation
    )
    torch.testing.assert_close(out.cpu().float(), expected, **TOLERANCE[dtype])
