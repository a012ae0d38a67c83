"""Mixture-of-experts models quantized at load (int8, int4 weight-only): tiny random Mixtral and
Qwen3-MoE run through the engine, every expert's weights shrink (and the KV budget gets the
bytes back), and the greedy tokens are those of the full-precision engine on the same weights
dequantized (tiny random models have near-ties everywhere, so comparing against the original
weights would test the rounding, not the experts' quantized path)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.layers.linear import Linear
from engine.layers.moe import FusedExperts
from engine.llm import LLM
from engine.quantization.weight_linear import QuantizedWeightLinear
from engine.quantization.weights import dequantize
from schemas.sampling import SamplingParams

TINY_MOE: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
}
PROMPTS = [[5, 9, 17, 3, 250, 42, 8], list(range(40, 75)), [7] * 3 + list(range(100, 160, 3))]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MEMORY_BUDGET = 8 << 20


def _llm(path: Path, quantization: str | None) -> LLM:
    """The quantized model on the CPU path the engine ships; the full-precision one on aten
    matmuls, whose plain weights the test can overwrite (no packed copies)."""
    return LLM(
        str(path),
        dtype="float32",
        quantization=quantization,
        memory_budget=MEMORY_BUDGET,
        **({} if quantization else dict(enforce_eager=True, cpu_matmul="aten")),
    )


def _copy_dequantized(quantized: torch.nn.Module, full: torch.nn.Module) -> None:
    """Write each quantized weight of `quantized`, dequantized, over the same weight of `full`."""
    modules = dict(full.named_modules())
    with torch.no_grad():
        for name, module in quantized.named_modules():
            target = modules[name]
            if isinstance(module, Linear) and isinstance(module.method, QuantizedWeightLinear):
                assert isinstance(target, Linear)
                target.weight.copy_(dequantize(module.method.weight))
            elif isinstance(module, FusedExperts):
                assert isinstance(target, FusedExperts) and module.quantized is not None
                w13, w2 = module.quantized
                for expert in range(module.num_experts):
                    target.w13[expert].copy_(dequantize(w13[expert]))
                    target.w2[expert].copy_(dequantize(w2[expert]))


def _experts_bytes(llm: LLM) -> tuple[int, int]:
    """(bytes the experts hold, bytes their float32 weights would take), over every layer."""
    held = plain = 0
    for module in llm.engine.runner.model.modules():
        if isinstance(module, FusedExperts):
            tensors = module.quantized_tensors() or [module.w13, module.w2]
            held += sum(t.numel() * t.element_size() for t in tensors)
            plain += (module.w13.numel() + module.w2.numel()) * 4
    return held, plain


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("kind", sorted(TINY_MOE))
def test_quantized_experts_run_shrink_and_keep_fp32_greedy(
    tiny_model_factory: Callable[..., Path], kind: str, quantization: str
) -> None:
    path = tiny_model_factory(kind, **TINY_MOE[kind])
    full, quantized = _llm(path, None), _llm(path, quantization)

    full_experts, plain = _experts_bytes(full)
    held, _ = _experts_bytes(quantized)
    assert full_experts == plain
    # int8: one byte per weight, int4: half a byte, plus the scales
    assert held < plain / (3 if quantization == "int8" else 5)
    assert held >= plain / (4 if quantization == "int8" else 8)  # every expert is counted
    saved = full.engine.weight_bytes - quantized.engine.weight_bytes
    assert saved >= plain - held  # the engine's weight bytes count every expert
    # what the weights no longer take goes to the KV cache under the same memory budget
    bytes_per_block = full.engine.runner.kv_spec.bytes_per_block
    more_blocks = quantized.engine.runner.num_kv_blocks - full.engine.runner.num_kv_blocks
    assert more_blocks >= saved // bytes_per_block - 1

    # the reference: the full-precision engine on the quantized model's weights dequantized
    _copy_dequantized(quantized.engine.runner.model, full.engine.runner.model)
    want = full.generate(PROMPTS, PARAMS, use_tqdm=False)
    got = quantized.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in want]
