"""PEFT as the reference for the LoRA tests: random adapters saved by save_pretrained, PEFT's
greedy tokens and logprobs, and the fixtures that build tiny base models."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from tests.engine.conftest import TINY_SIZES, _randomize, save_tiny_model

peft = pytest.importorskip("peft")

NEW_TOKENS = 8
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)


# Families tests/engine/conftest.py does not build: transformers class names (config, model).
_MORE_FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
}


def save_tiny(path: Path, kind: str, **overrides: object) -> Path:
    if kind not in _MORE_FAMILIES:
        return save_tiny_model(path, kind, **overrides)
    import transformers as tf

    config_name, model_name = _MORE_FAMILIES[kind]
    config = getattr(tf, config_name)(**{**TINY_SIZES, **overrides})
    torch.manual_seed(0)
    model = getattr(tf, model_name)(config).float().eval()
    _randomize(model, 0)
    model.save_pretrained(path)
    return path


def load_base(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_adapter(
    base_path: Path,
    out: Path,
    seed: int,
    rank: int = 8,
    targets: list[str] | None = None,
    alpha: float = 16.0,
    use_rslora: bool = False,
) -> Path:
    """A PEFT LoRA adapter of random A and nonzero random B, saved by save_pretrained."""
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        use_rslora=use_rslora,
        lora_dropout=0.0,
    )
    model = peft.get_peft_model(load_base(base_path), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(noise * 0.5 / param.shape[-1] ** 0.5)
    model.save_pretrained(out)
    return out


def peft_greedy(
    base_path: Path, adapter: Path | None, prompts: list[list[int]]
) -> list[tuple[list[int], list[float]]]:
    """PEFT's (or the base model's) greedy tokens and their logprobs, one prompt at a time."""
    model = load_base(base_path)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids, logprobs = list(prompt), []
            for _ in range(NEW_TOKENS):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                token = int(logits.argmax())
                logprobs.append(float(logits.log_softmax(-1)[token]))
                ids.append(token)
            results.append((ids[len(prompt) :], logprobs))
    return results


def tokens_and_logprobs(output) -> tuple[list[int], list[float]]:  # type: ignore[no-untyped-def]
    completion = output.outputs[0]
    return completion.token_ids, [entry.logprob for entry in completion.logprobs]


def assert_close(got, expected) -> None:  # type: ignore[no-untyped-def]
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected, strict=True):
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=2e-4)


def prompts_of(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 40, 9, 25, 33][:count]
    return [torch.randint(1, 250, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(params=["native", "padded", "per_slot"])
def lora_term(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every way a layer computes the LoRA terms: in one C++ call (the CPU's), or in torch ops
    (CUDA's), every slot's at once in a padded block or each slot's rows apart (chosen by how
    much padding a step needs; forced here)."""
    from engine.lora import batched

    if request.param == "native":
        return str(request.param)
    monkeypatch.setattr(batched, "_NATIVE_TERMS", False)
    limit = 1 << 30 if request.param == "padded" else -1
    monkeypatch.setattr(batched, "_PADDING_PER_ROW", limit)
    monkeypatch.setattr(batched, "_PADDING_PER_SLOT", limit)
    return str(request.param)


@pytest.fixture
def build(tmp_path: Path) -> Callable[..., Path]:
    counter = iter(range(1000))

    def make(kind: str, **overrides: object) -> Path:
        return save_tiny(tmp_path / f"{kind}-{next(counter)}", kind, **overrides)

    return make
