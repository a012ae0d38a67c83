"""reshape_and_cache (Triton) writes exactly what its plain-torch twin writes."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import reshape_and_cache_ref

pytest.importorskip("triton")


def _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape).to(dtype).to(device), torch.randn(shape).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(3, 64), (8, 128)])
def test_matches_reference_and_skips_padding_slots(dtype, num_kv_heads, head_dim, device):
    """(8, 128): wide tokens, so the 9 tokens span several programs."""
    from kernels import reshape_and_cache

    num_tokens, block_size, num_blocks = 9, 16, 4
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    slots = slots.to(device)
    k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    k_before = k_cache.clone()
    k_expected, v_expected = k_cache.clone(), v_cache.clone()

    reshape_and_cache(k, v, k_cache, v_cache, slots)
    reshape_and_cache_ref(k, v, k_expected, v_expected, slots)

    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)
    written = set(slots.tolist()) - {-1}
    assert len(written) == num_tokens - 2
    untouched = [s for s in range(num_blocks * block_size) if s not in written]
    assert torch.equal(k_cache.flatten(0, 1)[untouched], k_before.flatten(0, 1)[untouched])


def test_strided_views_of_a_fused_qkv_output(device):
    """k and v sliced out of one [T, (Hq + 2 Hkv) * D] buffer, as the attention layer makes them."""
    from kernels import reshape_and_cache

    num_tokens, num_q_heads, num_kv_heads, head_dim = 5, 4, 2, 32
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, device=device)
    _, k, v = qkv.split(
        [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
    )
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.tensor([3, 17, 0, 31, 8], device=device)
    k_cache, v_cache = _caches(2, 16, num_kv_heads, head_dim, torch.float32, device)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()

    reshape_and_cache(k, v, k_cache, v_cache, slots)
    reshape_and_cache_ref(k, v, k_expected, v_expected, slots)

    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)
    assert torch.equal(k_cache[1, 1], k[1])  # slot 17 = block 1, offset 1
