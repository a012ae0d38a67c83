"""Engine test fixtures: tiny random HF model folders (Llama, Qwen2) and the default model path.

Tiny models get weights re-drawn at a scale where logits vary by O(1) across the vocabulary
(HF's default init gives near-constant logits, which would make any parity check vacuous).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

TINY_SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)


def save_tiny_model(path: Path, kind: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Save a random tiny HF model folder; kind is "llama", "qwen2", "qwen3", "mistral", "gemma2",
    "gemma3", or a mixture-of-experts family: "mixtral", "qwen2_moe", "qwen3_moe"."""
    import transformers as tf

    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    config = config_cls(**{**TINY_SIZES, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    return path


def transformers_greedy(
    model_path: Path, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt in float32, run one at a time (no
    padding), exactly new_tokens long."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=model.config.eos_token_id or 0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture
def tiny_model_factory(tmp_path: Path) -> Callable[..., Path]:
    """make(kind="llama", **config overrides) -> a folder holding a random tiny HF model."""
    counter = iter(range(1000))

    def make(kind: str = "llama", **overrides: Any) -> Path:
        return save_tiny_model(tmp_path / f"{kind}-{next(counter)}", kind, **overrides)

    return make


@pytest.fixture
def tiny_llama_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture
def tiny_qwen2_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model's HF folder; skips the test when it is not prepared on this machine."""
    from engine.model_files import DEFAULT_MODEL, ModelNotFoundError, resolve_model_path

    try:
        return resolve_model_path(DEFAULT_MODEL)
    except ModelNotFoundError as exc:
        pytest.skip(f"default model unavailable: {exc}")
