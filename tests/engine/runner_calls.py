"""The raw logits of a model step, asked of the runner through its one execute entry."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.model_runner import ModelRunner
from engine.runner_io import RowMode, SamplingBatch
from engine.scheduler_output import SchedulerOutput
from engine.sequence import ScheduledSeq


def step_logits(
    runner: ModelRunner,
    scheduled: list[ScheduledSeq],
    block_copies: Sequence[tuple[int, int]] = (),
) -> torch.Tensor:
    """float32 [rows, vocab]: the logits rows of the step's sampling entries, in order."""
    step = SchedulerOutput(scheduled=scheduled, block_copies=list(block_copies))
    out = runner.execute(step, SamplingBatch.uniform(scheduled, RowMode.LOGITS))
    if not out.logits:
        return torch.empty(0, runner.vocab_size, dtype=torch.float32, device=runner.device)
    return torch.cat([rows for _, rows in out.logits])
