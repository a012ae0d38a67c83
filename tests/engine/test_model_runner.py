"""ModelRunner set-up and bookkeeping: dummy weights, KV-cache sizing, copy-on-write, purity."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from engine.config import EngineConfig
from engine.kv_cache import KVCache, KVCacheSpec
from engine.model_runner import ModelRunner
from engine.sequence import ScheduledSeq, Sequence
from schemas.sampling import SamplingParams
from tests.engine.conftest import TINY_SIZES
from tests.engine.runner_calls import step_logits


def _dummy_runner(hf_config, **overrides) -> ModelRunner:
    config = EngineConfig(model="dummy", device="cpu", load_format="dummy", **overrides)
    return ModelRunner(config, None, hf_config=hf_config)


def _prefill(runner: ModelRunner, token_ids: list[int], blocks: list[int]) -> torch.Tensor:
    seq = Sequence("r", list(token_ids), len(token_ids), SamplingParams(), block_table=blocks)
    return step_logits(runner, [ScheduledSeq(seq, len(token_ids))])


@pytest.mark.parametrize("config_cls", [LlamaConfig, Qwen2Config])
def test_dummy_weights_need_only_a_config(config_cls) -> None:
    hf_config = config_cls(**TINY_SIZES)
    # One fixed matmul backend and no compiled glue: each runner's start-up measurement may
    # choose other kernels on a loaded machine, whose fp32 rounding would differ in the last
    # bits; what is compared here is the weights the seed makes.
    fixed = {"num_kv_blocks": 16, "block_size": 4, "cpu_matmul": "aten", "enforce_eager": True}
    runner = _dummy_runner(hf_config, **fixed)
    logits = _prefill(runner, list(range(10)), [3, 1, 2])
    assert logits.shape == (1, hf_config.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0  # not a degenerate constant
    # Deterministic from the seed: a second runner with the same seed gives the same logits.
    again = _prefill(_dummy_runner(hf_config, **fixed), list(range(10)), [0, 1, 2])
    torch.testing.assert_close(logits, again)
    other_seed = _dummy_runner(hf_config, **fixed, seed=1)
    assert not torch.allclose(logits, _prefill(other_seed, list(range(10)), [0, 1, 2]))


def test_dummy_weights_stay_finite_at_depth() -> None:
    hf_config = LlamaConfig(**{**TINY_SIZES, "num_hidden_layers": 24})
    runner = _dummy_runner(hf_config, num_kv_blocks=64, block_size=16)
    assert torch.isfinite(_prefill(runner, list(range(200)), list(range(13)))).all()


def test_kv_cache_memory_budget_sets_the_block_count() -> None:
    hf_config = LlamaConfig(**TINY_SIZES)
    budget = 3_000_000
    runner = _dummy_runner(hf_config, kv_cache_memory=budget, block_size=8)
    block_bytes = (
        2
        * hf_config.num_hidden_layers
        * 8
        * hf_config.num_key_value_heads
        * hf_config.head_dim
        * runner.dtype.itemsize  # auto: bf16 on a CPU with native bf16, else fp32
    )
    assert runner.num_kv_blocks == budget // block_bytes
    cache = runner.kv_cache.tensor
    assert cache.numel() * cache.element_size() <= budget
    assert cache.numel() * cache.element_size() + block_bytes > budget


def test_explicit_block_count_wins_over_the_budget() -> None:
    runner = _dummy_runner(LlamaConfig(**TINY_SIZES), num_kv_blocks=7, kv_cache_memory=1 << 30)
    assert runner.num_kv_blocks == 7
    assert runner.kv_cache.tensor.shape[2] == 7


def test_copy_blocks_copies_every_layer_and_reads_sources_before_writing() -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2, dtype=torch.float32)
    cache = KVCache(spec, num_blocks=6, device="cpu")
    cache.tensor.copy_(torch.randn(cache.tensor.shape))
    before = cache.tensor.clone()
    cache.copy_blocks([(1, 4), (4, 5)])  # 5 gets 4's old content, not 1's
    assert torch.equal(cache.tensor[:, :, 4], before[:, :, 1])
    assert torch.equal(cache.tensor[:, :, 5], before[:, :, 4])
    for block in (0, 1, 2, 3):
        assert torch.equal(cache.tensor[:, :, block], before[:, :, block])


def test_block_copies_run_before_the_step(tiny_llama_dir) -> None:
    """A forked sequence whose shared last block was copied continues exactly like the parent."""
    runner = ModelRunner(
        EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=32, block_size=4), tiny_llama_dir
    )
    prompt = list(range(20, 30))  # 10 tokens: blocks 0, 1 full, block 2 half full
    parent = Sequence("p", [*prompt, 5], len(prompt), SamplingParams(), block_table=[0, 1, 2])
    step_logits(runner, [ScheduledSeq(parent, len(prompt))])
    parent.num_computed_tokens = len(prompt)
    child = Sequence("c", [*prompt, 5], len(prompt), SamplingParams(), block_table=[0, 1, 9])
    child.num_computed_tokens = len(prompt)
    logits = step_logits(
        runner, [ScheduledSeq(parent, 1), ScheduledSeq(child, 1)], block_copies=[(2, 9)]
    )
    # Rows of one fp32 batch may round differently in the last bits (MKL picks kernels by
    # shape); a missing copy would differ by O(1), since the child would read an empty block.
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


def test_execute_leaves_sequences_untouched(tiny_llama_dir) -> None:
    runner = ModelRunner(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=8), tiny_llama_dir)
    seq = Sequence("r", list(range(12)), 12, SamplingParams(), block_table=[4])
    logits = step_logits(runner, [ScheduledSeq(seq, 5)])  # a partial prefill chunk: nothing samples
    assert logits.shape == (0, runner.vocab_size)
    assert seq.num_computed_tokens == 0 and seq.token_ids == list(range(12))
    assert seq.block_table == [4]


def test_short_block_table_is_an_error(tiny_llama_dir) -> None:
    runner = ModelRunner(
        EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=8, block_size=4), tiny_llama_dir
    )
    seq = Sequence("r", list(range(9)), 9, SamplingParams(), block_table=[0, 1])
    with pytest.raises(ValueError, match="needs 3 KV blocks"):
        step_logits(runner, [ScheduledSeq(seq, 9)])


def test_sliding_window_models_serve_past_their_window() -> None:
    """The attention applies the window, so the context is not capped there."""
    from transformers import MistralConfig

    windowed = _dummy_runner(MistralConfig(**TINY_SIZES, sliding_window=64), num_kv_blocks=4)
    assert windowed.max_model_len == TINY_SIZES["max_position_embeddings"]
    unwindowed = _dummy_runner(Qwen2Config(**TINY_SIZES), num_kv_blocks=4)  # window off
    assert unwindowed.max_model_len == TINY_SIZES["max_position_embeddings"]
    with pytest.raises(ValueError, match="max_model_len"):
        _dummy_runner(LlamaConfig(**TINY_SIZES), num_kv_blocks=4, max_model_len=10_000)


def test_last_layer_skips_unsampled_rows_but_stores_their_kv(tiny_llama_dir) -> None:
    """A prefill step's logits, and the decode after it, match a forward that kept every row:
    the last layer leaves out the rows nobody samples, never their K/V."""

    def runner() -> ModelRunner:
        config = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=16, block_size=4)
        return ModelRunner(config, tiny_llama_dir)

    def sequences() -> list[Sequence]:
        return [
            Sequence("a", [*range(20, 31), 7], 11, SamplingParams(), block_table=[0, 1, 2]),
            Sequence("b", [*range(40, 46), 9], 6, SamplingParams(), block_table=[3, 4]),
        ]

    pruned, full = runner(), runner()
    pruned_seqs, full_seqs = sequences(), sequences()
    logits = step_logits(pruned, [ScheduledSeq(s, s.num_prompt_tokens) for s in pruned_seqs])
    inputs = full.prepare_inputs([ScheduledSeq(s, s.num_prompt_tokens) for s in full_seqs])
    assert inputs.sample_rows is not None
    with torch.inference_mode():
        hidden = full.model(
            inputs.input_ids, inputs.positions, full.kv_cache.layers, inputs.attn_meta
        )
        expected = full.model.compute_logits(hidden[inputs.sample_rows])
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)

    for seqs in (pruned_seqs, full_seqs):
        for s in seqs:
            s.num_computed_tokens = s.num_prompt_tokens
    decoded = step_logits(pruned, [ScheduledSeq(s, 1) for s in pruned_seqs])
    reference = step_logits(full, [ScheduledSeq(s, 1) for s in full_seqs])
    torch.testing.assert_close(decoded, reference, atol=1e-5, rtol=1e-5)
