"""An encoder's batches are padded to their longest input, so the pooling engine groups waiting
inputs of like lengths: fewer padded tokens than arrival order, the oldest input always in the
next batch, the budget kept, and every input's vector its own."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.llm import LLM
from engine.pooling.engine import PoolingEngine
from engine.pooling.outputs import PoolingRequest

TOKEN_BUDGET = 256
MAX_NUM_SEQS = 32


@pytest.fixture(scope="module")
def engine(minilm_path: Path) -> PoolingEngine:
    llm = LLM(str(minilm_path), max_num_batched_tokens=TOKEN_BUDGET, max_num_seqs=MAX_NUM_SEQS)
    engine = llm.pooling_engine
    assert engine.runner.is_encoder and engine.token_budget == TOKEN_BUDGET
    return engine


def _inputs(count: int, seed: int) -> list[list[int]]:
    """Token ids of mixed lengths in arrival order: short and long inputs interleaved, as a
    corpus's lines come."""
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(4, 12), rng.randint(40, 64)]) for _ in range(count)]
    return [[101] + [rng.randrange(1000, 20000) for _ in range(n - 2)] + [102] for n in lengths]


def _run(engine: PoolingEngine, inputs: list[list[int]]) -> tuple[list[list[str]], dict]:
    """Each step's request ids (a step finishes every request it runs), and every result by
    request id."""
    for index, token_ids in enumerate(inputs):
        engine.add_request(PoolingRequest(f"r{index}", token_ids))
    batches: list[list[str]] = []
    results: dict = {}
    while engine.has_unfinished():
        step = engine.step()
        batches.append([result.request_id for result in step])
        for result in step:
            assert result.request_id not in results
            results[result.request_id] = result
    return batches, results


def test_like_lengths_pad_less_than_arrival_order_and_keep_the_budget(
    engine: PoolingEngine,
) -> None:
    inputs = _inputs(96, seed=3)
    length = {f"r{i}": len(ids) for i, ids in enumerate(inputs)}
    batches, results = _run(engine, inputs)

    assert sorted(results) == sorted(length)  # every input once
    padded = 0
    for batch in batches:
        longest = max(length[r] for r in batch)
        assert len(batch) * longest <= TOKEN_BUDGET and len(batch) <= MAX_NUM_SEQS
        padded += len(batch) * longest

    # Arrival order under the same budget, as the engine batched before.
    in_order, rows, longest = 0, 0, 0
    for n in length.values():
        if rows and ((rows + 1) * max(longest, n) > TOKEN_BUDGET or rows == MAX_NUM_SEQS):
            in_order += rows * longest
            rows, longest = 0, 0
        rows, longest = rows + 1, max(longest, n)
    in_order += rows * longest
    real = sum(length.values())
    assert padded < in_order
    assert padded <= 1.15 * real, (padded, real, in_order)


def test_the_oldest_input_runs_in_the_next_step(engine: PoolingEngine) -> None:
    """A long input among many short ones is not left waiting for lengths like its own."""
    inputs = [[101] + [2000] * 60 + [102]] + [[101, 3000 + i, 102] for i in range(80)]
    batches, _ = _run(engine, inputs)
    assert "r0" in batches[0]
    # Each later step also takes whichever input waited longest.
    taken: set[str] = set()
    for batch in batches:
        oldest = min((f"r{i}" for i in range(len(inputs)) if f"r{i}" not in taken),
                     key=lambda r: int(r[1:]))  # fmt: skip
        assert oldest in batch
        taken.update(batch)


def test_each_vector_is_its_inputs_own(engine: PoolingEngine) -> None:
    inputs = _inputs(24, seed=7)
    _, together = _run(engine, inputs)
    for index in (0, 5, 11, 23):
        _, alone = _run(engine, [inputs[index]])
        a, b = together[f"r{index}"].data, alone["r0"].data
        assert together[f"r{index}"].prompt_token_ids == inputs[index]
        assert 1 - F.cosine_similarity(a.double(), b.double(), dim=0) < 1e-5
        assert not torch.equal(a, together[f"r{(index + 1) % 24}"].data)
