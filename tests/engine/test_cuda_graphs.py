"""Decode steps through the static buffers of the CUDA-graph runner.

On the CPU there is no graph to record, so the capture here replays by re-running the recorded
step function: it reads only the static buffers, exactly as a replayed graph would. That checks
what the graph runner itself adds (copying inputs in, padding a batch to a captured size with
inert rows, slicing the output) against eager steps, with the Triton backend the graphs run on
CUDA (interpreted on the CPU).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.cuda_graphs import StepFn, capture_sizes
from engine.model_runner import ModelRunner
from tests.engine.test_model_parity import TRITON_DEVICE, _make_runner, _run_schedule

# Prefills of 7, 13, 1 and 5 tokens, then decode-only steps of 4 sequences (exact size), of 3
# (padded to 4: the padding row still holds sequence 3's inputs and must not write its cache),
# of 1 and 2, and of all 4 again, sequence 3 reading the context the padded steps left alone.
PROMPT_LENGTHS = [7, 13, 1, 5]
SCHEDULE = [
    [(0, 7), (1, 13), (2, 1), (3, 5)],
    *[[(0, 1), (1, 1), (2, 1), (3, 1)]] * 2,
    *[[(0, 1), (1, 1), (2, 1)]] * 3,
    [(1, 1)],
    [(2, 1), (0, 1)],
    *[[(3, 1), (2, 1), (1, 1), (0, 1)]] * 3,
]


class RerunCapture:
    """A stand-in for CUDA graph capture: replay() re-runs the step on the static buffers."""

    def __init__(self) -> None:
        self.replays = 0

    def __call__(self, step: StepFn) -> tuple[object, torch.Tensor]:
        output = step()

        def replay() -> None:
            self.replays += 1
            output.copy_(step())

        return replay, output


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(256)[-2:] == [240, 256]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_graph_decode_steps_match_eager_steps(tiny_model_factory, kind: str) -> None:
    pytest.importorskip("triton")  # on CPU-only machines tests/conftest.py selects the interpreter
    model_path = tiny_model_factory(kind, tie_word_embeddings=True)
    rng = random.Random(2)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENGTHS]

    eager_runner = _make_runner(model_path, backend="triton", device=TRITON_DEVICE)
    eager_prompts = [list(p) for p in prompts]
    eager = _run_schedule(eager_runner, eager_prompts, SCHEDULE)

    graph_runner: ModelRunner = _make_runner(model_path, backend="triton", device=TRITON_DEVICE)
    graph_runner.config.max_num_seqs = 8
    graph_runner.decode_graphs = graph_runner.make_decode_graphs()
    capture = RerunCapture()
    graph_runner.decode_graphs.capture(capture)
    assert list(graph_runner.decode_graphs.captured_sizes) == [1, 2, 4, 8]
    graph_prompts = [list(p) for p in prompts]
    graphed = _run_schedule(graph_runner, graph_prompts, SCHEDULE)

    assert capture.replays == len(SCHEDULE) - 1  # every decode-only step went through a graph
    assert graph_prompts == eager_prompts  # the same greedy tokens
    assert graphed.keys() == eager.keys()
    for key, row in eager.items():
        torch.testing.assert_close(graphed[key], row, atol=1e-5, rtol=1e-5)


def test_a_failed_capture_leaves_the_runner_eager(tiny_model_factory, monkeypatch, caplog) -> None:
    """A driver or kernel that cannot be captured costs speed, never the worker."""
    import engine.model_runner as model_runner

    def failing_capture(pool: object) -> object:
        def capture(step: StepFn) -> None:
            raise RuntimeError("operation not permitted when stream is capturing")

        return capture

    monkeypatch.setattr(model_runner.ModelRunner, "_wants_cuda_graphs", lambda self: True)
    monkeypatch.setattr(model_runner, "cuda_graph_capture", failing_capture)
    monkeypatch.setattr(model_runner.torch.cuda, "graph_pool_handle", lambda: None)
    runner = _make_runner(tiny_model_factory("llama"), backend="triton", device=TRITON_DEVICE)
    assert runner.decode_graphs is None
    assert runner.piecewise_graphs is None
    assert "CUDA graph capture failed" in caplog.text
    assert "piecewise CUDA graph capture failed" in caplog.text
    prompts = [[3, 4, 5], [6]]
    logits = _run_schedule(runner, prompts, [[(0, 3), (1, 1)], [(0, 1), (1, 1)]])
    assert len(logits) == 4  # both steps ran eagerly
