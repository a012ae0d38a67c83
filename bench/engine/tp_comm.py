"""Time spent in tensor-parallel communication on the driver rank, per engine step.

Wraps the driver's collectives (all-reduce, logits gather) and the step broadcast with a clock.
A collective's time includes waiting for the slowest rank, so on a shared or unevenly split
machine it is an upper bound on the wire cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CommunicationClock:
    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    steps: int = 0

    @classmethod
    def attach(cls, llm: Any) -> CommunicationClock | None:
        """A clock on llm's driver rank; None without tensor parallelism."""
        runner = llm.engine.runner
        if runner.tp is None or runner.step_sender is None:
            return None
        clock = cls()
        tp, sender = runner.tp, runner.step_sender
        tp.all_reduce = clock._timed("all_reduce", tp.all_reduce)
        tp.all_gather_last_dim = clock._timed("gather_logits", tp.all_gather_last_dim)
        send = clock._timed("step_broadcast", sender.send)

        def counted_send(message: Any) -> None:
            clock.steps += 1
            send(message)

        sender.send = counted_send
        return clock

    def _timed(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
                self.calls[name] = self.calls.get(name, 0) + 1

        return wrapper

    def report(self, size: int) -> dict[str, Any]:
        steps = max(self.steps, 1)
        per_step = {name: 1e3 * s / steps for name, s in self.seconds.items()}
        total = sum(per_step.values())
        detail = ", ".join(f"{name} {ms:.2f}" for name, ms in per_step.items())
        print(
            f"tensor parallel {size}: {total:.2f} ms communication per step ({detail}), {steps} steps"
        )
        return {"steps": self.steps, "ms_per_step": per_step, "total_ms_per_step": total}
