"""gpt-oss against transformers' GptOssForCausalLM: a tiny random model (fp32, seed fixed) whose
sliding layers' window (8) is shorter than the prompts, with yarn rope as the released configs
use it, sink logits large enough to take much of each softmax, and a SwiGLU limit low enough to
clamp. Greedy tokens must equal transformers' for every prompt alone, batched, after a
prefix-cache hit and with prefills in chunks, on the CPU path the engine ships (C++ kernels)
and on the plain-torch one (no C++ kernels, aten matmuls).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.attention.torch_backend import TorchAttentionBackend
from engine.models import meta_model, served_architecture
from engine.models.interface import AttentionKind
from kernels import cpu_ops
from tests.engine.conftest import TINY_SIZES, _randomize, transformers_greedy
from tests.engine.test_model_families import (  # noqa: F401 (plain_torch: a fixture)
    NEW_TOKENS,
    TOKEN_IDS,
    _check_family,
    _generate,
    _prompts,
    plain_torch,
)

WINDOW = 8
GPT_OSS = dict(
    num_hidden_layers=4,  # sliding, full, sliding, full
    sliding_window=WINDOW,
    num_local_experts=6,
    num_experts_per_tok=2,
    intermediate_size=32,
    swiglu_limit=1.0,
    # No end-of-sequence token: transformers' min_new_tokens bans it, while ignore_eos only
    # keeps generating past it, so the two would part where greedy picks it.
    eos_token_id=None,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 64,
        "truncate": False,
    },
)


def _config(**overrides: object) -> object:
    from transformers import GptOssConfig

    return GptOssConfig(**{**TINY_SIZES, **TOKEN_IDS, **GPT_OSS, **overrides})


def _save(path: Path, sink_scale: float = 2.0, seed: int = 0) -> Path:
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(_config()).float().eval()
    _randomize(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            sinks = layer.self_attn.sinks
            sinks.copy_(sink_scale * torch.randn(sinks.shape, generator=generator))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("gpt_oss"))


def test_the_reference_depends_on_the_sinks_and_the_window(
    gpt_oss_dir: Path, tmp_path: Path
) -> None:
    """Parity below means something: transformers' tokens change without the sinks (a sink of
    -1e4 takes nothing) and with a window covering every prompt."""
    prompts = _prompts()
    expected = transformers_greedy(gpt_oss_dir, prompts, NEW_TOKENS)
    without_sinks = _save(tmp_path / "no-sinks", sink_scale=0.0)
    from transformers import GptOssForCausalLM

    model = GptOssForCausalLM.from_pretrained(without_sinks, dtype=torch.float32)
    for layer in model.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)
    model.save_pretrained(without_sinks)
    assert transformers_greedy(without_sinks, prompts, NEW_TOKENS) != expected
    wide = GptOssForCausalLM.from_pretrained(gpt_oss_dir, dtype=torch.float32)
    wide.config.sliding_window = 512
    wide.save_pretrained(tmp_path / "wide")
    assert transformers_greedy(tmp_path / "wide", prompts, NEW_TOKENS) != expected


def test_gpt_oss_matches_transformers(gpt_oss_dir: Path) -> None:
    _check_family(gpt_oss_dir, False if cpu_ops.cpu_kernels_available() else None)


@pytest.mark.usefixtures("plain_torch")
def test_gpt_oss_matches_transformers_on_plain_torch(gpt_oss_dir: Path) -> None:
    prompts = _prompts()
    expected = transformers_greedy(gpt_oss_dir, prompts, NEW_TOKENS)
    for chunk in (None, 8):
        llm = LLM(
            str(gpt_oss_dir),
            dtype="float32",
            enforce_eager=True,
            cpu_matmul="aten",
            **({} if chunk is None else {"max_num_batched_tokens": chunk}),
        )
        assert not cpu_ops.cpu_kernels_available()
        assert _generate(llm, prompts) == expected


def test_layers_alternate_windows_and_the_architecture_is_reported() -> None:
    config = _config()
    model = meta_model(config, TorchAttentionBackend())
    kinds = [spec.kind for spec in model.attention_specs()]
    assert kinds == [AttentionKind.SLIDING, AttentionKind.FULL] * 2
    assert model.sliding_window() == WINDOW
    assert served_architecture(config) == "GptOssForCausalLM"


def test_an_unsupported_rope_scaling_is_refused_by_name() -> None:
    config = _config(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(NotImplementedError, match="'dynamic'"):
        meta_model(config, TorchAttentionBackend())


def test_quantizing_its_experts_is_refused(gpt_oss_dir: Path) -> None:
    """int8 would quantize every linear but the experts, which hold most of the weights."""
    from engine.quantization.errors import QuantizationError

    with pytest.raises(QuantizationError, match="gpt-oss's experts"):
        LLM(str(gpt_oss_dir), dtype="float32", quantization="int8")
