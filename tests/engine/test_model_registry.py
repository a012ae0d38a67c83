"""The model registry and what a family tells the engine through the CausalLM interface."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

from engine.attention.torch_backend import TorchAttentionBackend
from engine.distributed.group import TensorParallel
from engine.kv_cache import KVCacheSpec
from engine.models import meta_model, model_factory, supported_architectures
from engine.models.interface import AttentionKind
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from tests.engine.conftest import TINY_SIZES


@pytest.mark.parametrize(
    ("config", "family"),
    [
        (LlamaConfig(**TINY_SIZES), LlamaForCausalLM),
        (MistralConfig(**TINY_SIZES), LlamaForCausalLM),
        (Qwen2Config(**TINY_SIZES), Qwen2ForCausalLM),
        (Qwen2Config(**TINY_SIZES, architectures=["Qwen2ForCausalLM"]), Qwen2ForCausalLM),
    ],
)
def test_configs_find_their_family_by_architecture_or_model_type(config, family) -> None:
    assert model_factory(config) is family


def test_an_unknown_architecture_is_refused_with_the_supported_list() -> None:
    config = PretrainedConfig(architectures=["NoSuchForCausalLM"])
    with pytest.raises(NotImplementedError, match="LlamaForCausalLM"):
        model_factory(config)
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} <= set(
        supported_architectures()
    )


def test_a_family_reports_its_layers_shapes_and_projections() -> None:
    model = meta_model(Qwen2Config(**TINY_SIZES), TorchAttentionBackend())
    specs = model.attention_specs()
    assert len(specs) == len(model.decoder_layers) == TINY_SIZES["num_hidden_layers"]
    assert {(s.num_heads, s.num_kv_heads, s.head_dim, s.kind) for s in specs} == {
        (8, 2, 16, AttentionKind.FULL)
    }
    layout = model.projections(0)
    assert [p.out_features for p in layout] == [(8 + 2 + 2) * 16, 64, 2 * 96, 64]
    assert layout.qkv.bias is not None and layout.o.bias is None  # Qwen2's q/k/v biases
    assert (model.vocab_size, model.hidden_size) == (256, 64)
    spec = KVCacheSpec.for_model(model, block_size=4, dtype=torch.float32)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (3, 2, 16)


def test_a_shard_reports_its_share_of_the_heads() -> None:
    config = LlamaConfig(**TINY_SIZES)
    shard = meta_model(config, TorchAttentionBackend(), TensorParallel(1, 2))
    assert (shard.attention_spec(2).num_heads, shard.attention_spec(2).num_kv_heads) == (4, 1)
    with pytest.raises(ValueError, match="cannot split"):
        meta_model(config, TorchAttentionBackend(), TensorParallel(0, 3))


def test_a_window_makes_every_layer_sliding_unless_turned_off() -> None:
    windowed = meta_model(MistralConfig(**TINY_SIZES, sliding_window=64), TorchAttentionBackend())
    assert {(s.kind, s.window) for s in windowed.attention_specs()} == {(AttentionKind.SLIDING, 64)}
    assert windowed.sliding_window() == 64
    off = Qwen2Config(**TINY_SIZES, sliding_window=64, use_sliding_window=False)
    assert meta_model(off, TorchAttentionBackend()).sliding_window() is None


def test_checkpoint_names_map_to_fused_shards() -> None:
    mapping = LlamaForCausalLM.weight_mapping
    assert mapping.target_of("model.layers.3.self_attn.k_proj.weight") == (
        "model.layers.3.self_attn.qkv_proj.weight",
        1,
    )
    assert mapping.target_of("model.layers.0.mlp.up_proj.bias") == (
        "model.layers.0.mlp.gate_up_proj.bias",
        1,
    )
    assert mapping.target_of("model.norm.weight") == ("model.norm.weight", None)
    assert mapping.ignores("model.layers.0.self_attn.rotary_emb.inv_freq")
