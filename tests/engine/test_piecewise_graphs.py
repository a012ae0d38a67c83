"""Steps with prefills through piecewise graphs: the forward cut at its attention calls.

On the CPU there is no graph to record, so the capture stand-in replays a piece by re-running
it on the static buffers it was recorded over, as a replayed graph would. That checks what the
piecewise runner adds (the cut forward, inputs copied into static buffers, padding to a
captured token count, eager attention on the real tokens between the pieces) against eager
steps: mixed prefill + decode batches and speculative verification must give the same logits
and the same tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_runner import ModelRunner
from engine.piecewise_graphs import PiecewiseGraphs, token_sizes
from tests.engine.test_model_parity import TRITON_DEVICE, _make_runner, _run_schedule

Out = TypeVar("Out")

# Token counts per step: 16 (a captured size exactly), 15 (padded to 16), 41 (over the largest
# captured size: eager), 17 (padded to 32), decode-only steps of 4 and 3 tokens, and 5 tokens
# of which sequence 1 (prompt done) and 4 (prompt in its last chunk) are mixed with decodes.
PROMPT_LENGTHS = [7, 45, 1, 8, 20]
SCHEDULE = [
    [(0, 7), (1, 8), (2, 1)],
    [(0, 1), (1, 5), (2, 1), (3, 8)],
    [(0, 1), (1, 32), (2, 1), (3, 1), (4, 6)],
    [(4, 14), (0, 1), (2, 1), (3, 1)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
    [(0, 1), (2, 1), (3, 1)],
    [(1, 1), (4, 1), (0, 1), (2, 1), (3, 1)],
]
MAX_TOKENS = 32


class RerunRecorder:
    """A stand-in for CUDA graph capture: replay() re-runs the piece on the static buffers and
    writes its results into the outputs of the recording run, where a graph leaves them."""

    def __init__(self) -> None:
        self.replays = 0

    def __call__(self, step: Callable[[], Out]) -> tuple[Callable[[], None], Out]:
        outputs = step()

        def replay() -> None:
            self.replays += 1
            fresh = step()
            assert isinstance(fresh, tuple) and isinstance(outputs, tuple)
            for static, new in zip(outputs, fresh, strict=True):
                static.copy_(new)

        return replay, outputs


def _piecewise(runner: ModelRunner, max_tokens: int = MAX_TOKENS) -> RerunRecorder:
    """Give runner piecewise graphs up to max_tokens, recorded by the stand-in."""
    runner.config.cuda_graph_max_tokens = max_tokens
    graphs = runner.make_piecewise_graphs()
    assert graphs is not None
    recorder = RerunRecorder()
    graphs.capture(recorder)
    runner.piecewise_graphs = graphs
    return recorder


def _record_steps(graphs: PiecewiseGraphs) -> list[int]:
    """The token count of every step the graphs run."""
    counts: list[int] = []
    run = graphs.run

    def recording_run(input_ids, positions, kv_caches, meta):  # type: ignore[no-untyped-def]
        counts.append(input_ids.shape[0])
        return run(input_ids, positions, kv_caches, meta)

    graphs.run = recording_run  # type: ignore[method-assign]
    return counts


def test_token_sizes_are_powers_of_two_up_to_the_cap() -> None:
    assert token_sizes(0) == []
    assert token_sizes(16) == [16]
    assert token_sizes(40) == [16, 32, 40]
    assert token_sizes(512) == [16, 32, 64, 128, 256, 512]


@pytest.mark.parametrize(
    ("kind", "backend", "overrides"),
    [
        ("llama", "torch", {"num_key_value_heads": 2}),
        ("gemma2", "torch", {}),  # norms after each sublayer, soft-capped scores
        ("qwen2", "triton", {"tie_word_embeddings": True}),  # the backend graphs run on CUDA
    ],
    ids=["llama-gqa", "gemma2-post-norms", "qwen2-triton"],
)
def test_piecewise_steps_match_eager_steps(
    tiny_model_factory, kind: str, backend: str, overrides: dict
) -> None:
    if backend == "triton":
        pytest.importorskip("triton")  # tests/conftest.py selects the interpreter on the CPU
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    model_path = tiny_model_factory(kind, **overrides)
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENGTHS]

    # On a GPU a runner captures real graphs unless told not to: the eager side must run
    # eagerly, and the other only through the stand-in's pieces (no whole-step decode graphs).
    eager_prompts = [list(p) for p in prompts]
    eager_runner = _make_runner(model_path, backend=backend, device=device, enforce_eager=True)
    eager = _run_schedule(eager_runner, eager_prompts, SCHEDULE)

    runner = _make_runner(model_path, backend=backend, device=device, enforce_eager=True)
    recorder = _piecewise(runner)
    assert runner.piecewise_graphs is not None
    assert list(runner.piecewise_graphs.captured_sizes) == [16, 32]
    steps = _record_steps(runner.piecewise_graphs)
    graph_prompts = [list(p) for p in prompts]
    graphed = _run_schedule(runner, graph_prompts, SCHEDULE)

    assert steps == [16, 15, 17, 4, 3, 5]  # the 41-token step ran eagerly
    num_layers = runner.model.split_forward().num_layers  # type: ignore[union-attr]
    assert recorder.replays == len(steps) * (num_layers + 1)
    assert graph_prompts == eager_prompts  # the same greedy tokens
    assert graphed.keys() == eager.keys()
    for key, row in eager.items():
        torch.testing.assert_close(graphed[key], row, atol=1e-5, rtol=1e-5)


def test_no_pieces_where_the_setting_is_zero(tiny_model_factory) -> None:
    runner = _make_runner(tiny_model_factory("llama"))
    runner.config.cuda_graph_max_tokens = 0
    assert runner.make_piecewise_graphs() is None


SPEC_TEXT = "the boat, the pier, the gulls and the boat, the pier, the gulls and " * 3
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}


def test_speculative_verification_through_pieces_keeps_the_tokens(
    default_model_path: Path,
) -> None:
    """Verification steps (each running sequence scoring its drafts) of the default model
    replay the pieces and still give plain greedy decoding's tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    ids = tokenizer.encode(SPEC_TEXT)
    prompts = [ids[:40], ids[5:30]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def generate(llm: LLM) -> list[list[int]]:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    path = str(default_model_path)
    expected = generate(LLM(path, dtype="float32", enforce_eager=True))

    llm = LLM(path, dtype="float32", enforce_eager=True, speculative_config=NGRAM)
    _piecewise(llm.engine.runner, max_tokens=128)
    assert llm.engine.runner.piecewise_graphs is not None
    steps = _record_steps(llm.engine.runner.piecewise_graphs)
    assert generate(llm) == expected
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0  # some steps verified drafts
    assert len(steps) == stats.num_steps  # every step went through the pieces
