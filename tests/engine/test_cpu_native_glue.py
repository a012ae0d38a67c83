"""The C++ glue ops of the CPU decode step agree with the eager torch ops they replace."""

from __future__ import annotations

import pytest
import torch

from engine.layers.rotary import RotaryEmbedding
from engine.platforms.cpu import glue as cpu_glue
from kernels import cpu_ops

pytestmark = pytest.mark.skipif(
    not cpu_ops.cpu_kernels_available(), reason="the CPU kernels cannot be built here"
)


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 300])
def test_native_glue_matches_eager(dtype: torch.dtype, num_tokens: int) -> None:
    torch.manual_seed(0)
    hidden, residual = torch.randn(2, num_tokens, 96).to(dtype)
    weight = torch.randn(96).to(dtype)
    gate_up = torch.randn(num_tokens, 2 * 40).to(dtype)
    native, eager = cpu_glue.native(), cpu_glue.EAGER
    with torch.inference_mode():
        pairs = [
            (glue.rms_norm(hidden, weight, 1e-5) for glue in (native, eager)),
            (glue.add_rms_norm(hidden, residual, weight, 1e-5) for glue in (native, eager)),
            (glue.silu_and_mul(gate_up) for glue in (native, eager)),
        ]
        for got, expected in pairs:
            torch.testing.assert_close(got, expected, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_kv_matches_rotating_then_storing(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 16, 4
    rotary = RotaryEmbedding(head_dim, 64, 10000.0)
    positions = torch.tensor([0, 5, 17, 63])
    slots = torch.tensor([3, -1, 9, 12])  # the second token is not stored
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(len(positions), q_size + 2 * kv_size).to(dtype)
    cache_shape = (5, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)

    with torch.inference_mode():
        q_got = cpu_ops.rotary_store_kv(
            qkv, positions, rotary.cos_sin_cache, slots, k_cache, v_cache, num_heads
        )
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q_want, k_want = rotary(positions, q.clone(), k.clone())

    torch.testing.assert_close(q_got, q_want, **_tolerance(dtype))
    stored = slots >= 0
    flat_k, flat_v = (
        k_cache.view(-1, num_kv_heads, head_dim),
        v_cache.view(-1, num_kv_heads, head_dim),
    )
    torch.testing.assert_close(flat_k[slots[stored]], k_want[stored], **_tolerance(dtype))
    assert torch.equal(flat_v[slots[stored]], v[stored].view(-1, num_kv_heads, head_dim))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[stored]] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()
