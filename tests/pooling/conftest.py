"""Pooling test fixtures: the shipped MiniLM folder (sentence-transformers' all-MiniLM-L6-v2)
and tiny random decoder embedding models made by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

TINY_QWEN3 = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    from engine.model_files import ModelNotFoundError, resolve_model_path

    try:
        return resolve_model_path("all-MiniLM-L6-v2")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


def save_sentence_transformers_modules(path: Path, pooling: str, normalize: bool) -> None:
    """modules.json and 1_Pooling/config.json as sentence-transformers writes them."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    modules.append(
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    )
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    flags = {
        "cls": "pooling_mode_cls_token",
        "mean": "pooling_mode_mean_tokens",
        "last": "pooling_mode_lasttoken",
    }
    config = {flag: kind == pooling for kind, flag in flags.items()}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))


def save_tiny_qwen3(path: Path, bare: bool, seed: int = 0) -> Path:
    """A random tiny Qwen3 saved as Qwen3ForCausalLM, or bare (Qwen3Model: no `model.` prefix
    and no LM head, as Qwen3-Embedding is)."""
    import transformers as tf

    config = tf.Qwen3Config(**TINY_QWEN3)
    torch.manual_seed(seed)
    model = (tf.Qwen3Model if bare else tf.Qwen3ForCausalLM)(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            scale = 0.1 if name.endswith("norm.weight") else param.shape[-1] ** -0.5
            param.copy_((1.0 if name.endswith("norm.weight") else 0.0) + scale * noise)
    model.save_pretrained(path)
    return path
