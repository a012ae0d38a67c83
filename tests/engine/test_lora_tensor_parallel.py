"""LoRA adapters under tensor parallelism (gloo, 2 ranks on the CPU): column-parallel layers
keep their rows of lora_B, row-parallel ones their columns of lora_A (the partial terms summed
by the layer's all-reduce), the lm_head its vocabulary rows; a sharded replica serving a mixed
batch of adapters says what a single device says."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine import LLM, LoRARequest
from tests.engine.lora_reference import (
    ALL_TARGETS,
    GREEDY,
    assert_close,
    build,
    make_adapter,
    prompts_of,
    tokens_and_logprobs,
)

__all__ = ["build"]  # fixtures

RANKS = 2


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("llama", {}),  # 8 heads, 2 KV heads: one per rank
        ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),  # KV replicated
    ],
    ids=["llama", "qwen2-one-kv-head"],
)
def test_a_sharded_replica_with_adapters_equals_one_device(
    build: Callable[..., Path], tmp_path: Path, kind: str, overrides: dict[str, object]
) -> None:
    base = build(kind, **overrides)
    everything = [*ALL_TARGETS, "embed_tokens", "lm_head"]
    full = make_adapter(base, tmp_path / "full", seed=1, rank=8, targets=everything)
    attention = make_adapter(
        base, tmp_path / "attn", seed=2, rank=4, targets=["q_proj", "v_proj", "o_proj"]
    )
    requests = [LoRARequest("full", 1, str(full)), LoRARequest("attn", 2, str(attention))]
    prompts = prompts_of(3)
    batch = [prompt for prompt in prompts for _ in range(3)]
    loras = [requests[0], None, requests[1]] * len(prompts)
    args = dict(
        dtype="float32",
        device="cpu",
        num_threads=1,
        enforce_eager=True,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    single = LLM(str(base), **args)
    expected = single.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)
    assert expected[0].outputs[0].token_ids != expected[1].outputs[0].token_ids
    sharded = LLM(str(base), tensor_parallel_size=RANKS, **args)
    try:
        got = sharded.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)
        # A later adapter, first asked for once the ranks run, reaches them too.
        late = make_adapter(base, tmp_path / "late", seed=3, rank=2, targets=["down_proj"])
        late_request = LoRARequest("late", 3, str(late))
        late_got = sharded.generate(prompts, GREEDY, use_tqdm=False, lora_request=late_request)
    finally:
        sharded.shutdown()
    late_expected = single.generate(prompts, GREEDY, use_tqdm=False, lora_request=late_request)
    for have, want in zip([*got, *late_got], [*expected, *late_expected], strict=True):
        assert have.outputs[0].finish_reason == "length", have.outputs[0].stop_reason
        assert_close([tokens_and_logprobs(have)], [tokens_and_logprobs(want)])
