"""Worker test fixtures: the default model, loaded once per session (tests that use it share
its engine one worker at a time; every worker stops with its engine empty)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # worker_fakes, worker_harness

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def smollm():
    """`engine.LLM` on the default model: the offline reference, and its engine for workers.

    float32, because tests compare greedy tokens across batch compositions: dtype auto may pick
    bf16 on a CPU with native bf16, whose rounding differs with the batch's row count and so
    can flip a near-tie."""
    from engine import LLM

    return LLM(DEFAULT_MODEL, dtype="float32")
