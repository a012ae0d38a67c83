"""Weight loading from HF folders: sharded checkpoints, fused projections, and bad checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from engine.attention.torch_backend import TorchAttentionBackend
from engine.models.checkpoint import WeightLoadError
from engine.models.loader import build_model
from tests.engine.conftest import save_tiny_model


def _build(path: Path) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(path)
    return build_model(
        config, TorchAttentionBackend(), torch.device("cpu"), torch.float32, model_path=path
    )


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    single = save_tiny_model(tmp_path / "single", "qwen2", seed=3)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a, b = _build(single), _build(tmp_path / "sharded")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_fused_projections_hold_the_checkpoint_rows(tmp_path: Path) -> None:
    path = save_tiny_model(tmp_path / "m", "qwen2")
    model = _build(path)
    state = load_file(path / "model.safetensors")
    attn = model.model.layers[1].self_attn
    prefix = "model.layers.1.self_attn."
    expected = torch.cat([state[prefix + f"{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, expected)
    expected_bias = torch.cat([state[prefix + f"{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.bias, expected_bias)
    mlp_prefix = "model.layers.1.mlp."
    gate_up = torch.cat(
        [state[mlp_prefix + "gate_proj.weight"], state[mlp_prefix + "up_proj.weight"]]
    )
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight, gate_up)


def test_missing_tensor_is_an_error(tmp_path: Path) -> None:
    path = save_tiny_model(tmp_path / "m", "llama")
    state = load_file(path / "model.safetensors")
    del state["model.layers.0.self_attn.v_proj.weight"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="qkv_proj"):
        _build(path)


def test_wrong_shape_is_an_error(tmp_path: Path) -> None:
    path = save_tiny_model(tmp_path / "m", "llama")
    state = load_file(path / "model.safetensors")
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"model\.norm\.weight"):
        _build(path)


def test_bfloat16_checkpoint_loads_into_float32(tmp_path: Path) -> None:
    path = save_tiny_model(tmp_path / "m", "llama")
    state = load_file(path / "model.safetensors")
    save_file({k: v.bfloat16() for k, v in state.items()}, path / "model.safetensors")
    model = _build(path)
    expected = state["model.embed_tokens.weight"].bfloat16().float()
    assert torch.equal(model.model.embed_tokens.weight, expected)
