"""The mixture-of-experts layer: routing as transformers routes, quantized experts close to
the float32 ones, every expert counted in the weight bytes, and tensor-parallel shards that
hold their slice of each expert and compute what one device computes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from engine.attention.torch_backend import TorchAttentionBackend
from engine.distributed.group import TensorParallel
from engine.layers.moe import FusedExperts, RouterSpec, Scoring, route
from engine.layers.moe.compute import padded_experts, reference_experts
from engine.models.checkpoint import TensorDictCheckpoint, WeightLoadError
from engine.models.loader import build_model, load_weights
from engine.quantization.int4 import Int4Linear
from engine.quantization.int8 import Int8Linear
from engine.quantization.methods import quantize_experts, weight_bytes
from tests.engine.test_tensor_parallel import RANKS, _runner, _stop, _three_steps

TINY_QWEN2_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    mlp_only_layers=[1],
)


def _hf_router(kind: str, experts: int, top_k: int, renormalize: bool) -> torch.nn.Module:
    import transformers as tf
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    if kind == "mixtral":
        config = tf.MixtralConfig(hidden_size=32, num_local_experts=experts)
        config.num_experts_per_tok = top_k
        return MixtralTopKRouter(config)
    config = tf.Qwen2MoeConfig(hidden_size=32, num_experts=experts, norm_topk_prob=renormalize)
    config.num_experts_per_tok = top_k
    return Qwen2MoeTopKRouter(config)


@pytest.mark.parametrize(
    ("kind", "scoring", "renormalize"),
    [
        ("mixtral", Scoring.TOPK_SOFTMAX, False),
        ("qwen2_moe", Scoring.SOFTMAX_TOPK, False),
        ("qwen2_moe", Scoring.SOFTMAX_TOPK, True),
    ],
)
def test_routing_matches_transformers(kind: str, scoring: Scoring, renormalize: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    router = _hf_router(kind, 8, 3, renormalize)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 32, generator=generator))
        x = torch.randn(50, 32, generator=generator)
        logits, expected_weights, expected_ids = router(x)
    weights, ids = route(logits, RouterSpec(8, 3, scoring, renormalize))
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights.float(), atol=1e-6, rtol=1e-6)


def _experts(num_experts: int = 6, hidden: int = 64, inter: int = 96) -> FusedExperts:
    generator = torch.Generator().manual_seed(1)
    experts = FusedExperts(num_experts, hidden, inter)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=generator) / hidden**0.5)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=generator) / inter**0.5)
    return experts


def _routes(tokens: int, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, num_experts, generator=torch.Generator().manual_seed(2))
    return route(logits, RouterSpec(num_experts, top_k, Scoring.SOFTMAX_TOPK, True))


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_both_cpu_expert_shapes_compute_the_definition(tokens: int) -> None:
    experts = _experts()
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(3))
    weights, ids = _routes(tokens, 6, 2)
    expected = reference_experts(x, experts.w13, experts.w2, weights, ids)
    with torch.no_grad():
        torch.testing.assert_close(experts(x, weights, ids), expected, atol=1e-5, rtol=1e-5)
        padded = padded_experts(x, experts.w13, experts.w2, weights, ids)
    torch.testing.assert_close(padded, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("method", "tolerance"), [(Int8Linear, 0.02), (Int4Linear, 0.15)])
def test_quantized_experts_stay_close_to_float32(method: type, tolerance: float) -> None:
    experts = _experts()
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(4))
    weights, ids = _routes(20, 6, 2)
    plain_bytes = weight_bytes(experts)
    with torch.no_grad():
        expected = experts(x, weights, ids)
        quantize_experts("experts", experts, method, group_size=32)
        got = experts(x, weights, ids)
    error = (got - expected).norm() / expected.norm()
    assert error < tolerance
    assert experts.w13.device.type == "meta"  # the float32 copies are freed
    assert weight_bytes(experts) < plain_bytes / (3 if method is Int8Linear else 5)


def test_weight_bytes_count_every_expert(tiny_model_factory: Callable[..., Path]) -> None:
    path = tiny_model_factory("mixtral", num_local_experts=8, intermediate_size=48)
    hf_config = AutoConfig.from_pretrained(str(path))
    model = build_model(
        hf_config, TorchAttentionBackend(), torch.device("cpu"), torch.float32, model_path=path
    )
    experts_bytes = 3 * hf_config.num_hidden_layers * 8 * 48 * hf_config.hidden_size * 4
    rest = sum(
        p.numel() * 4 for name, p in model.named_parameters() if ".experts." not in name
    ) + sum(b.numel() * b.element_size() for b in model.buffers())
    assert weight_bytes(model) == experts_bytes + rest


def test_a_checkpoint_missing_an_expert_is_refused(tiny_model_factory: Callable[..., Path]) -> None:
    path = tiny_model_factory("qwen2_moe", **TINY_QWEN2_MOE)
    hf_config = AutoConfig.from_pretrained(str(path))
    model = build_model(
        hf_config, TorchAttentionBackend(), torch.device("cpu"), torch.float32, load_format="dummy"
    )
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.mlp\.experts\.w13"):
        load_weights(model, TensorDictCheckpoint(tensors))


def test_each_rank_holds_its_slice_of_every_expert(
    tiny_model_factory: Callable[..., Path],
) -> None:
    path = tiny_model_factory("qwen2_moe", **TINY_QWEN2_MOE)
    hf_config = AutoConfig.from_pretrained(str(path))

    def load(tp: TensorParallel | None) -> torch.nn.Module:
        backend = TorchAttentionBackend()
        return build_model(
            hf_config, backend, torch.device("cpu"), torch.float32, model_path=path, tp=tp
        )

    whole = dict(load(None).named_parameters())
    parts = [dict(load(TensorParallel(rank, RANKS)).named_parameters()) for rank in range(RANKS)]
    w13, w2 = "model.layers.0.mlp.experts.w13", "model.layers.0.mlp.experts.w2"
    inter = TINY_QWEN2_MOE["moe_intermediate_size"] // RANKS
    for rank, part in enumerate(parts):
        assert part[w13].shape == (4, 2 * inter, hf_config.hidden_size)
        gate, up = whole[w13].split(TINY_QWEN2_MOE["moe_intermediate_size"], dim=1)
        rows = slice(rank * inter, (rank + 1) * inter)
        assert torch.equal(part[w13], torch.cat([gate[:, rows], up[:, rows]], dim=1))
    assert torch.equal(torch.cat([p[w2] for p in parts], dim=2), whole[w2])


def test_sharded_moe_logits_match_single_device(tiny_model_factory: Callable[..., Path]) -> None:
    path = tiny_model_factory("qwen2_moe", **TINY_QWEN2_MOE)
    expected = _three_steps(_runner(path, 1))
    sharded = _runner(path, RANKS)
    try:
        got = _three_steps(sharded)
    finally:
        _stop(sharded)
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert torch.allclose(have, want, atol=1e-4, rtol=0), (step, (have - want).abs().max())
