"""What one scheduler step decided: the sequences it runs (running ones first, then the ones it
admitted) with their new tokens, the block copies (copy on write) to run before the forward
pass, and the sequences it preempted. The scheduler makes one per step; the model runner, the
output processor and the speculative drafter read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_manager import BlockCopy
from engine.sequence import ScheduledSeq, Sequence


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # running first, then admitted
    block_copies: list[BlockCopy] = field(default_factory=list)  # run before the forward pass
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
