"""The CUDA path on a real GPU: the compiled Triton kernels, CUDA graphs and the KV-cache sizing.

Skipped without a GPU. On the CPU the same code runs under the Triton interpreter and a graph
stand-in (test_model_parity.py, test_cuda_graphs.py); these tests are what shows it on CUDA.
References come from transformers in float32 on the CPU, or from the engine's own eager,
non-speculative decoding on CUDA.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.beam_search import BeamSearchParams
from engine.cuda_graphs import capture_sizes
from engine.model_runner import ModelRunner
from tests.engine.conftest import save_tiny_model, transformers_greedy
from tests.engine.test_beam_search_parity import reference_beams
from tests.engine.test_model_parity import BF16_ATOL, CONFIGS, _check_parity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# SmolLM2-135M's shapes (the default model) with random weights: head_dim 64, 9 query heads
# sharing 3 KV heads, 30 layers, a tied 49k vocabulary. The real weights would not fit the
# device machine's transfer limit; the kernels and graphs see the same shapes.
SMOLLM2_SHAPES = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
PROMPT_LENGTHS = [1, 5, 17, 64, 130, 300]
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(autouse=True)
def _free_gpu_memory() -> Iterator[None]:
    """Each test's engines go before the next test sizes its KV cache from free memory."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def smollm2_shaped_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("smollm2-shaped"), "llama", **SMOLLM2_SHAPES)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(SMOLLM2_SHAPES["vocab_size"]) for _ in range(n)] for n in PROMPT_LENGTHS]


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _cuda_llm(model_path: Path, **engine_args: object) -> LLM:
    args: dict[str, object] = {"dtype": "float32", "gpu_memory_utilization": 0.3}
    return LLM(str(model_path), device="cuda", **{**args, **engine_args})


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_triton_kernels_on_cuda_match_transformers_logits(tiny_model_factory, kind: str) -> None:
    model_kind, overrides = CONFIGS[kind]
    _check_parity(tiny_model_factory(model_kind, **overrides), backend="triton", device="cuda")


@pytest.mark.parametrize("kind", ["llama3-rope-gqa4", "qwen2-qkv-bias"])
def test_bfloat16_on_cuda_stays_close_to_float32_transformers(tiny_model_factory, kind) -> None:
    model_kind, overrides = CONFIGS[kind]
    _check_parity(
        tiny_model_factory(model_kind, **overrides),
        backend="triton",
        dtype="bfloat16",
        atol=BF16_ATOL,
        device="cuda",
    )


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_greedy_tokens_on_cuda_match_transformers(
    smollm2_shaped_dir: Path, prompts: list[list[int]], enforce_eager: bool
) -> None:
    reference = transformers_greedy(smollm2_shaped_dir, prompts, NEW_TOKENS)
    llm = _cuda_llm(smollm2_shaped_dir, enforce_eager=enforce_eager, max_num_seqs=8)
    assert (llm.engine.runner.decode_graphs is None) == enforce_eager
    assert _tokens(llm, [prompts[3]]) == [reference[3]]  # alone
    assert _tokens(llm, prompts) == reference  # batched, prefills beside decodes


def _record_graph_batches(runner: ModelRunner) -> list[int]:
    """The padded batch size of every decode step that replays a graph."""
    graphs = runner.decode_graphs
    assert graphs is not None
    sizes = list(graphs.captured_sizes)
    replayed: list[int] = []
    run: Callable[..., torch.Tensor] = graphs.run

    def recording_run(input_ids, positions, meta):  # type: ignore[no-untyped-def]
        replayed.append(next(s for s in sizes if s >= meta.num_seqs))
        return run(input_ids, positions, meta)

    graphs.run = recording_run  # type: ignore[method-assign]
    return replayed


def test_cuda_graphs_replay_every_captured_size_with_eager_tokens(tiny_model_factory) -> None:
    """Requests of 2..21 new tokens: decode steps shrink from 20 sequences to 1, so every
    captured size (padded ones too) replays; the tokens must equal eager decoding's."""
    model_path = tiny_model_factory("llama", num_key_value_heads=2)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(1, 40))] for _ in range(20)]
    params = [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True) for i in range(20)]

    eager = _cuda_llm(model_path, enforce_eager=True, max_num_seqs=20)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager
    gc.collect()
    torch.cuda.empty_cache()

    graphed = _cuda_llm(model_path, max_num_seqs=20)
    runner = graphed.engine.runner
    assert runner.decode_graphs is not None
    assert list(runner.decode_graphs.captured_sizes) == capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    replayed = _record_graph_batches(runner)
    outputs = graphed.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert set(replayed) == set(capture_sizes(20))


@pytest.mark.parametrize("utilization", [0.25, 0.5])
def test_kv_cache_fills_gpu_memory_utilization(smollm2_shaped_dir: Path, utilization) -> None:
    """The engine's whole footprint (weights, graphs, KV cache, the CUDA context) lands just
    under the fraction asked for: the KV cache takes what the rest leaves."""
    free_before, total = torch.cuda.mem_get_info()
    assert total - free_before < 0.2 * total, "another process holds the GPU"
    llm = _cuda_llm(smollm2_shaped_dir, dtype="bfloat16", gpu_memory_utilization=utilization)
    free, _ = torch.cuda.mem_get_info()
    used = total - free
    runner = llm.engine.runner
    kv_bytes = runner.num_kv_blocks * runner.kv_spec.bytes_per_block
    assert used <= (utilization + 0.01) * total
    assert used >= (utilization - 0.03) * total
    assert kv_bytes >= (utilization - 0.1) * total
    assert _tokens(llm, [[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4)) != [[]]


def test_beam_search_on_cuda_matches_transformers(
    smollm2_shaped_dir: Path, prompts: list[list[int]]
) -> None:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_shaped_dir, dtype=torch.float32)
    hf_model.eval().generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    hf_model.config.eos_token_id = None
    llm = _cuda_llm(smollm2_shaped_dir, enforce_eager=True)
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    for prompt, output in zip(prompts[1:4], llm.beam_search(prompts[1:4], params), strict=True):
        expected = reference_beams(hf_model, prompt, 3)
        assert [beam.token_ids for beam in output.outputs] == expected


def test_speculative_decoding_on_cuda_matches_plain_decoding(
    smollm2_shaped_dir: Path, prompts: list[list[int]]
) -> None:
    # Repetitive prompts, so the n-gram proposer has drafts to verify.
    repetitive = [(p[:8] * 12)[: 24 + 8 * i] for i, p in enumerate(prompts[2:5])]
    plain_llm = _cuda_llm(smollm2_shaped_dir)
    plain = _tokens(plain_llm, repetitive)
    del plain_llm  # the next engine sizes its KV cache from what this one frees
    gc.collect()
    torch.cuda.empty_cache()
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}
    speculative = _cuda_llm(smollm2_shaped_dir, speculative_config=ngram)
    assert _tokens(speculative, repetitive) == plain
    assert speculative.engine.stats().spec_num_accepted_tokens > 0
