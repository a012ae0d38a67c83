"""Deployment test fixtures: the worker tests' harness (real worker subprocesses) and the
default model's offline engine as the reference for greedy outputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))  # worker_harness

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def smollm():
    """`engine.LLM` on the default model: the offline reference.

    float32, as its workers run, because tests compare greedy tokens across batch compositions
    and crashes: dtype auto may pick bf16, whose rounding differs with the batch's row count."""
    from engine import LLM

    return LLM(DEFAULT_MODEL, dtype="float32")
