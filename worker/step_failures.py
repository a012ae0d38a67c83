"""Which job a failed engine step was the fault of.

The engine cannot say which request made a step raise, but the worker can find out: it takes
the step's jobs out of the engine (each keeps its output so far, to rejoin from, as a crash
resume does) and runs them again in halves, one probe group per step, the rest waiting. A
probe that raises again holds the culprit (the other suspects wait their turn after the
search); a probe that passes is innocent (its jobs made a step's progress meanwhile). Only a
job that raises alone is failed. A step re-runs a request from the state it had in the failed
step (prompt and output so far), so a request whose own state makes the engine raise does it
again; an error that no probe reproduces fails nobody.

Bounds: a search takes at most about `2 * log2(n) + 1` steps for `n` jobs, during which this
worker reads no new jobs (other workers take them); after `MAX_UNEXPLAINED_FAILURES` searches
in a row that reproduced nothing, with no clean step between them, the next failing step fails
its jobs as a whole, so an engine that fails only with a full batch cannot search forever.

An out-of-memory error on a device is a batch too big, not a request at fault: the jobs of the
step leave the engine and rejoin at most half as many at a time (`Batch.engine_cap`, raised by
one per job that finishes after it); only a job that runs out of memory alone is failed.
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from dataclasses import dataclass, field

MAX_UNEXPLAINED_FAILURES = 3


def is_out_of_memory(error: BaseException) -> bool:
    """A device out of memory (torch's OutOfMemoryError). torch is not imported here: the
    worker's event loop thread must not load it (worker.engine_thread), and an error raised by
    torch means the engine thread loaded it already."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(error, torch.OutOfMemoryError)


@dataclass
class Bisect:
    """The search for the job of a failed step that reproduces its error. Job ids only: the
    batch owns the jobs and removes the ones that end meanwhile (`alive`)."""

    error: str
    suspects: list[str]
    probe: list[str] = field(default_factory=list)  # the group in the engine now
    steps: int = 0

    def next_probe(self, alive: Collection[str], cap: int | None) -> list[str]:
        """The group to run next (kept until its step reports): the first half of the
        suspects, or the last suspect alone. Empty: no suspect is left."""
        if not self.probe:
            self.suspects = [job for job in self.suspects if job in alive]
            size = max(1, len(self.suspects) // 2)
            self.probe = self.suspects[: min(size, cap or size)]
        return self.probe

    def probe_failed(self) -> str | None:
        """The probe raised: the culprit when the probe was one job, else the probe is what is
        left to search."""
        self.steps += 1
        probe, self.probe = self.probe, []
        if len(probe) == 1:
            return probe[0]
        self.suspects = probe
        return None

    def probe_passed(self) -> bool:
        """The probe stepped cleanly: its jobs are innocent. True when no suspect is left
        (the error was not reproduced)."""
        self.steps += 1
        passed, self.probe = set(self.probe), []
        self.suspects = [job for job in self.suspects if job not in passed]
        return not self.suspects
