"""Mixture-of-experts families against transformers in float32: the same greedy tokens alone,
batched, with chunked prefill and after a prefix-cache hit, on the CPU path the engine ships
(measured matmul plans, compiled glue) and on the plain-torch one (aten matmuls, eager)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from tests.engine.conftest import transformers_greedy

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [
    [5, 9, 17, 3, 250, 42, 8],
    [1, 2, 3],
    list(range(40, 75)),
    [7] * 3 + list(range(100, 160, 3)),
]
TINY_MOE: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[1],
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    "qwen2_moe_renormalized": dict(
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=40,
        decoder_sparse_step=2,
        norm_topk_prob=True,
    ),
}
PATHS = {
    "shipped": {},
    "plain_torch": dict(enforce_eager=True, cpu_matmul="aten"),
}


@pytest.fixture(params=sorted(TINY_MOE))
def moe_case(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]):
    name = request.param
    kind = name.removesuffix("_renormalized")
    path = tiny_model_factory(kind, **TINY_MOE[name])
    return path, transformers_greedy(path, PROMPTS, NEW_TOKENS)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(PATHS))
def test_moe_family_matches_transformers(moe_case, path: str) -> None:
    model_dir, reference = moe_case
    llm = LLM(str(model_dir), dtype="float32", **PATHS[path])
    assert llm.engine.runner.model.model.cpu_decode_stack is None  # MoE opts out of it
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        assert _generate(llm, [prompt]) == [expected], f"prompt of {len(prompt)} tokens"
    assert _generate(llm, PROMPTS) == reference

    chunked = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=16, **PATHS[path])
    assert _generate(chunked, PROMPTS) == reference


@pytest.mark.slow
def test_moe_prefix_cache_hit_matches_transformers(moe_case) -> None:
    model_dir, _ = moe_case
    shared = list(range(10, 42))  # two full blocks of 16
    first, second = [*shared, 3, 4, 5], [*shared, 200, 201]
    expected = transformers_greedy(model_dir, [second], NEW_TOKENS)
    llm = LLM(str(model_dir), dtype="float32")
    _generate(llm, [first])
    out = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_cached_prompt_tokens == 32
    assert [list(out.outputs[0].token_ids)] == expected
