"""Piecewise CUDA graphs on a real GPU: steps with prefills replay captured pieces.

Skipped without a GPU; test_piecewise_graphs.py checks the same runner on the CPU with a
capture stand-in. Here the pieces are real torch.cuda.CUDAGraph captures and the attention
between them the Triton kernels; the tokens must equal eager steps'.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.piecewise_graphs import PiecewiseGraphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}


@pytest.fixture(autouse=True)
def _free_gpu_memory() -> Iterator[None]:
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _llm(model_path: Path, **engine_args: object) -> LLM:
    args: dict[str, object] = {
        "device": "cuda",
        "dtype": "float32",
        "gpu_memory_utilization": 0.3,
        "max_num_seqs": 4,  # later prompts join running decodes: mixed steps
        "max_num_batched_tokens": 64,  # long prompts in chunks
    }
    return LLM(str(model_path), **{**args, **engine_args})


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _record_query_lens(graphs: PiecewiseGraphs) -> list[int]:
    """The longest query of every step the pieces run."""
    lens: list[int] = []
    run = graphs.run

    def recording_run(input_ids, positions, kv_caches, meta):  # type: ignore[no-untyped-def]
        lens.append(meta.max_query_len)
        return run(input_ids, positions, kv_caches, meta)

    graphs.run = recording_run  # type: ignore[method-assign]
    return lens


def _eager_tokens(model_path: Path, prompts: list[list[int]]) -> list[list[int]]:
    eager = _llm(model_path, enforce_eager=True)
    assert eager.engine.runner.piecewise_graphs is None
    tokens = _tokens(eager, prompts)
    del eager
    gc.collect()
    torch.cuda.empty_cache()
    return tokens


def test_mixed_steps_replay_pieces_with_eager_tokens(tiny_model_factory) -> None:
    model_path = tiny_model_factory("llama", num_key_value_heads=2)
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(1, 90))] for _ in range(10)]
    expected = _eager_tokens(model_path, prompts)

    llm = _llm(model_path, cuda_graph_max_tokens=64)
    graphs = llm.engine.runner.piecewise_graphs
    assert graphs is not None
    assert list(graphs.captured_sizes) == [16, 32, 64]
    query_lens = _record_query_lens(graphs)
    assert _tokens(llm, prompts) == expected
    assert any(n > 1 for n in query_lens)  # steps with prefills went through the pieces


def test_speculative_verification_replays_pieces_with_plain_tokens(tiny_model_factory) -> None:
    model_path = tiny_model_factory("llama", num_key_value_heads=2)
    pattern = [5, 17, 42, 9, 77, 3]
    prompts = [pattern * 6, [11, 12] + pattern * 4]  # repeats: the n-gram proposer drafts
    expected = _eager_tokens(model_path, prompts)

    llm = _llm(model_path, cuda_graph_max_tokens=64, speculative_config=NGRAM)
    graphs = llm.engine.runner.piecewise_graphs
    assert graphs is not None
    query_lens = _record_query_lens(graphs)
    assert _tokens(llm, prompts) == expected
    assert llm.engine.stats().spec_num_draft_tokens > 0
    assert query_lens  # verification steps went through the pieces
