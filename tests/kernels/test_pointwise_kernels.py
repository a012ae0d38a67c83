"""rms_norm, rotary_embedding and silu_and_mul (Triton) against their plain-torch twins."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.reference import rms_norm_ref, rotary_embedding_ref, silu_and_mul_ref

pytest.importorskip("triton")

TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _randn(*shape, dtype, device, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype, device):
    from kernels import rms_norm

    x = _randn(2, 3, 576, dtype=dtype, device=device)
    weight = _randn(576, dtype=dtype, device=device, seed=1)
    out = rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-5), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_residual_add(dtype, device):
    from kernels import rms_norm

    x = _randn(5, 200, dtype=dtype, device=device)
    residual = _randn(5, 200, dtype=dtype, device=device, seed=1)
    weight = _randn(200, dtype=dtype, device=device, seed=2)
    x_before, residual_before = x.clone(), residual.clone()

    out, new_residual = rms_norm(x, weight, 1e-6, residual=residual)
    out_ref, new_residual_ref = rms_norm_ref(x, weight, 1e-6, residual=residual)

    if dtype == torch.bfloat16:
        # The interpreter truncates fp32 -> bf16 where GPUs round to nearest: allow one ulp.
        torch.testing.assert_close(new_residual, new_residual_ref, atol=0, rtol=2**-7)
    else:
        assert torch.equal(new_residual, new_residual_ref)  # rounds like the unfused add
    torch.testing.assert_close(out, out_ref, **TOLERANCE[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def _hf_rotate_half_oracle(x, positions, cos_sin_cache, head_dim):
    """Transformers' apply_rotary_pos_emb formula: x * cos + rotate_half(x) * sin."""
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[:, None, :], torch.cat([sin, sin], -1)[:, None, :]
    heads = x.view(x.shape[0], -1, head_dim).float()
    x1, x2 = heads.chunk(2, dim=-1)
    return (heads * cos + torch.cat([-x2, x1], -1) * sin).view(x.shape[0], -1)


def _cos_sin_cache(max_pos, rotary_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def test_rotary_reference_matches_transformers_formula(device):
    head_dim, positions = 64, torch.tensor([0, 7, 3, 100], device=device)
    cache = _cos_sin_cache(128, head_dim).to(device)
    q = _randn(4, 3 * head_dim, dtype=torch.float32, device=device)
    k = _randn(4, 1 * head_dim, dtype=torch.float32, device=device, seed=1)
    q_expected = _hf_rotate_half_oracle(q, positions, cache, head_dim)
    k_expected = _hf_rotate_half_oracle(k, positions, cache, head_dim)
    rotary_embedding_ref(positions, q, k, cache, head_dim)
    torch.testing.assert_close(q, q_expected)
    torch.testing.assert_close(k, k_expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_on_fused_qkv_views(dtype, head_dim, device):
    """q/k are column slices of one qkv buffer; v (the rest of the buffer) must stay untouched."""
    from kernels import rotary_embedding

    num_tokens, num_q_heads, num_kv_heads = 6, 3, 1
    sizes = [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = _randn(num_tokens, sum(sizes), dtype=dtype, device=device)
    qkv_expected = qkv.clone()
    positions = torch.tensor([0, 1, 2, 50, 9, 200], device=device)
    cache = _cos_sin_cache(256, head_dim).to(device)

    q, k, _ = qkv.split(sizes, dim=-1)
    rotary_embedding(positions, q, k, cache, head_dim)
    q_ref, k_ref, _ = qkv_expected.split(sizes, dim=-1)
    rotary_embedding_ref(positions, q_ref, k_ref, cache, head_dim)

    torch.testing.assert_close(qkv, qkv_expected, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, -sizes[2] :], qkv_expected[:, -sizes[2] :])


def test_rotary_partial_rotary_dim_leaves_tail_untouched(device):
    from kernels import rotary_embedding

    head_dim, rotary_dim = 64, 32
    q = _randn(3, 2 * head_dim, dtype=torch.float32, device=device)
    k = _randn(3, head_dim, dtype=torch.float32, device=device, seed=1)
    q_ref, k_ref = q.clone(), k.clone()
    positions = torch.tensor([4, 0, 11], device=device)
    cache = _cos_sin_cache(16, rotary_dim).to(device)
    rotary_embedding(positions, q, k, cache, head_dim)
    rotary_embedding_ref(positions, q_ref, k_ref, cache, head_dim)
    torch.testing.assert_close(q, q_ref, **TOLERANCE[torch.float32])
    torch.testing.assert_close(k, k_ref, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, device):
    from kernels import silu_and_mul

    x = _randn(2, 3, 2 * 1500, dtype=dtype, device=device)  # 1500: two column blocks, one ragged
    out = silu_and_mul(x)
    assert out.shape == (2, 3, 1500)
    torch.testing.assert_close(out, silu_and_mul_ref(x), **TOLERANCE[dtype])
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(out.float(), F.silu(gate) * up, **TOLERANCE[dtype])
