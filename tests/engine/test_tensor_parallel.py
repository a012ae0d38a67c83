"""Tensor parallelism on the CPU (gloo, 2 ranks, 1 thread each): a sharded replica computes
what a single device computes, and each rank holds only its shard of the weights."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineConfig
from engine.distributed.group import TensorParallel
from engine.layers.norm import RMSNorm
from engine.layers.parallel import split_heads
from engine.model_runner import ModelRunner
from engine.models.loader import build_model
from engine.quantization.methods import weight_bytes
from engine.sequence import ScheduledSeq, Sequence
from schemas.sampling import SamplingParams
from tests.engine.runner_calls import step_logits

RANKS = 2


def _runner(path: Path, tensor_parallel_size: int) -> ModelRunner:
    config = EngineConfig(
        model=str(path),
        tensor_parallel_size=tensor_parallel_size,
        device="cpu",
        dtype="float32",
        num_threads=1,
        num_kv_blocks=32,
        enforce_eager=True,
    )
    return ModelRunner(config, path)


def _stop(runner: ModelRunner) -> None:
    if runner.tp_ranks is not None:
        runner.tp_ranks.stop()


def _seq(name: str, tokens: list[int], first_block: int) -> Sequence:
    return Sequence(
        request_id=name,
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        params=SamplingParams(),
        block_table=list(range(first_block, first_block + 4)),
    )


def _three_steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of a mixed workload: a whole prefill beside a partial chunk, then the rest of the
    chunk beside a decode, then a decode of both with a copy-on-write block copy."""
    a = _seq("a", [(7 * i + 3) % 250 for i in range(37)], 0)
    b = _seq("b", [(5 * i + 1) % 250 for i in range(29)], 4)
    logits = [step_logits(runner, [ScheduledSeq(a, 37), ScheduledSeq(b, 20)])]
    a.num_computed_tokens, b.num_computed_tokens = 37, 20
    a.append_token(int(logits[0][0].argmax()))
    logits.append(step_logits(runner, [ScheduledSeq(a, 1), ScheduledSeq(b, 9)]))
    a.num_computed_tokens, b.num_computed_tokens = 38, 29
    a.append_token(int(logits[1][0].argmax()))
    b.append_token(int(logits[1][1].argmax()))
    b.block_table[0] = 12  # its first block, copied: the copy must reach every rank's cache
    logits.append(step_logits(runner, [ScheduledSeq(a, 1), ScheduledSeq(b, 1)], [(4, 12)]))
    return logits


# kind -> (transformers family, config overrides); built only when a test asks for the kind
TINY_MODELS: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("llama", {}),  # 8 heads, 2 KV heads: one per rank
    "qwen2-one-kv-head": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    # fewer KV heads than ranks: replicated; q/k/v biases; tied lm_head
    "gemma2": ("gemma2", dict(sliding_window=8)),
    # Gemma's blocks: soft-capped scores and logits, (1 + weight) and sandwich norms,
    # scaled embeddings, a window shorter than the sequences
    "gemma3": (
        "gemma3",
        dict(
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),  # per-head QK-norm, local layers with their own rope base beside a global one
    "qwen3": ("qwen3", {}),  # per-head QK-norm weights, whole on every rank
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    # each rank holds its slice of every expert's intermediate dim
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=30,  # not a multiple of 4: the ranks' slices are uneven
            norm_topk_prob=True,
            mlp_only_layers=[0],  # a dense layer beside the sparse ones
        ),
    ),
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,  # a row-parallel shared expert beside them
        ),
    ),
}


class _TinyModels:
    def __init__(self, factory: Callable[..., Path]) -> None:
        self.factory = factory

    def __getitem__(self, kind: str) -> Path:
        family, overrides = TINY_MODELS[kind]
        return self.factory(family, **overrides)


@pytest.fixture
def tiny_models(tiny_model_factory: Callable[..., Path]) -> _TinyModels:
    return _TinyModels(tiny_model_factory)


@pytest.mark.parametrize("kind", sorted(TINY_MODELS))
def test_sharded_logits_match_single_device(tiny_models: _TinyModels, kind: str) -> None:
    path = tiny_models[kind]
    single = _runner(path, 1)
    expected = _three_steps(single)
    sharded = _runner(path, RANKS)
    try:
        assert sharded.num_kv_blocks == single.num_kv_blocks
        got = _three_steps(sharded)
    finally:
        _stop(sharded)
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have.shape == want.shape, step
        assert torch.allclose(have, want, atol=1e-4, rtol=0), (step, (have - want).abs().max())


def test_each_rank_holds_its_shard(tiny_models: _TinyModels) -> None:
    """Each rank's weights are 1/N of the model's plus the replicated norms and rotary table,
    and the ranks' shards put together are the model's weights."""
    path = tiny_models["llama"]
    hf_config = AutoConfig.from_pretrained(str(path))

    def load(tp: TensorParallel | None) -> torch.nn.Module:
        return build_model(
            hf_config,
            TorchAttentionBackend(),
            torch.device("cpu"),
            torch.float32,
            model_path=path,
            tp=tp,
        )

    full = load(None)
    shards = [load(TensorParallel(rank, RANKS)) for rank in range(RANKS)]
    norms = [p for m in full.modules() if isinstance(m, RMSNorm) for p in m.parameters()]
    replicated = sum(t.numel() * t.element_size() for t in [*norms, *full.buffers()])
    sharded_bytes = weight_bytes(full) - replicated
    for shard in shards:
        assert weight_bytes(shard) == sharded_bytes // RANKS + replicated
    whole = dict(full.named_parameters())
    parts = [dict(shard.named_parameters()) for shard in shards]
    # column-parallel: rows; row-parallel: columns; vocab: rows
    assert torch.equal(
        torch.cat([p["model.layers.0.mlp.down_proj.weight"] for p in parts], dim=1),
        whole["model.layers.0.mlp.down_proj.weight"],
    )
    assert torch.equal(
        torch.cat([p["model.embed_tokens.weight"] for p in parts]),
        whole["model.embed_tokens.weight"],
    )
    q_rows = whole["model.layers.1.self_attn.qkv_proj.weight"][: 8 * 16]
    assert torch.equal(parts[1]["model.layers.1.self_attn.qkv_proj.weight"][: 4 * 16], q_rows[64:])


def test_heads_split_by_kv_group() -> None:
    def split(heads: int, kv_heads: int, size: int) -> list[tuple[int, int, int]]:
        parts = [split_heads(heads, kv_heads, 16, TensorParallel(r, size)) for r in range(size)]
        return [(p.num_heads, p.num_kv_heads, p.kv.start // 16) for p in parts]

    # fewer KV heads than ranks: each KV head replicated on the ranks that read it
    assert split(8, 2, 4) == [(2, 1, 0), (2, 1, 0), (2, 1, 1), (2, 1, 1)]
    # the default model's 9 heads in 3 KV groups over 2 ranks: whole groups, 2 and 1
    assert split(9, 3, 2) == [(3, 1, 0), (6, 2, 1)]
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        split_heads(8, 2, 16, TensorParallel(0, 3))


@pytest.mark.parametrize(
    ("size", "quantization", "message"),
    [
        (RANKS, "int8", "quantization='int8' with tensor_parallel_size=2"),
        (3, None, "tensor_parallel_size=3 cannot split 8 attention heads with 2 KV heads"),
    ],
)
def test_what_cannot_be_sharded_is_refused_before_ranks_start(
    tiny_models: _TinyModels, size: int, quantization: str | None, message: str
) -> None:
    config = EngineConfig(
        model="x", tensor_parallel_size=size, device="cpu", quantization=quantization
    )
    with pytest.raises(ValueError, match=message):
        ModelRunner(config, tiny_models["llama"])


def test_speculative_decoding_with_ranks_is_refused_before_ranks_start(
    tiny_models: _TinyModels,
) -> None:
    config = EngineConfig(
        model="x",
        tensor_parallel_size=RANKS,
        device="cpu",
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    with pytest.raises(ValueError, match="speculative_config with tensor_parallel_size=2"):
        ModelRunner(config, tiny_models["llama"])


PREAMBLE = (
    "You are a careful assistant. Answer briefly and precisely, in plain English, without "
    "lists unless asked, and say so when you do not know. Question: "
)
PROMPTS = [
    PREAMBLE + "The capital of France is",
    PREAMBLE + "Write a haiku about the sea.",
    PREAMBLE + "List three prime numbers:",
    PREAMBLE + "Once upon a time, in a small village by the mountains,",
    PREAMBLE + "Explain what a hash table is in one sentence.",
    PREAMBLE + "The capital of France is Paris. The capital of Italy is",
    PREAMBLE + "def fibonacci(n):",
    PREAMBLE + "Translate to French: good morning",
]


@pytest.fixture(scope="module")
def greedy_pair(default_model_path: Path) -> Iterator[tuple[object, object]]:
    from engine.llm import LLM

    args = dict(
        device="cpu",
        dtype="float32",
        num_threads=1,
        enforce_eager=True,
        max_num_batched_tokens=24,  # prompts arrive in several chunks
        enable_prefix_caching=True,
        kv_cache_memory=64 << 20,
    )
    single = LLM(str(default_model_path), **args)
    sharded = LLM(str(default_model_path), tensor_parallel_size=RANKS, **args)
    yield single, sharded
    sharded.shutdown()


def test_default_model_greedy_equal_alone_and_batched(greedy_pair: tuple[object, object]) -> None:
    from engine.llm import LLM

    single, sharded = greedy_pair
    assert isinstance(single, LLM) and isinstance(sharded, LLM)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = sharded.generate(PROMPTS, params, use_tqdm=False)
    expected = single.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in expected]
    # One at a time, after the batch: prompts now hit the prefix cache.
    for prompt, want in zip(PROMPTS, expected, strict=True):
        alone = sharded.generate([prompt], params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == want.outputs[0].token_ids
    assert sharded.engine.block_manager.prefix_cache_hits > 0


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_each_rank_holds_its_slice_of_every_expert(tiny_models: _TinyModels, kind: str) -> None:
    """Experts shard like a gated MLP: each rank holds a slice of every expert's intermediate
    dim (gate and up rows, down columns), and the slices put together are the experts."""
    path = tiny_models[kind]
    hf_config = AutoConfig.from_pretrained(str(path))

    def load(tp: TensorParallel | None) -> dict[str, torch.Tensor]:
        model = build_model(
            hf_config,
            TorchAttentionBackend(),
            torch.device("cpu"),
            torch.float32,
            model_path=path,
            tp=tp,
        )
        return dict(model.named_parameters())

    whole = load(None)
    parts = [load(TensorParallel(rank, RANKS)) for rank in range(RANKS)]
    w13, w2 = "model.layers.1.mlp.experts.w13", "model.layers.1.mlp.experts.w2"
    half = whole[w13].shape[1] // 2
    gates = [p[w13][:, : p[w13].shape[1] // 2] for p in parts]
    ups = [p[w13][:, p[w13].shape[1] // 2 :] for p in parts]
    assert torch.equal(torch.cat(gates, dim=1), whole[w13][:, :half])
    assert torch.equal(torch.cat(ups, dim=1), whole[w13][:, half:])
    assert torch.equal(torch.cat([p[w2] for p in parts], dim=2), whole[w2])
