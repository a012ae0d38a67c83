"""The worker's outbox, also noting each succeeded job's TTFT for the live stats.

The TTFTs wait in a `TtftBuffer` and go to Redis with the next heartbeat (worker.heartbeat), so
recording them adds no command to the step's pipeline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from schemas import JobField, JobStatus
from worker.heartbeat import TtftBuffer
from worker.publisher import Outbox


@dataclass
class RecordingOutbox(Outbox):
    ttfts: TtftBuffer = field(default_factory=TtftBuffer)

    def finish(
        self,
        job_id: str,
        entry_id: str,
        status: JobStatus,
        fields: dict[str, object],
        on_done: Callable[[bool, JobStatus | None], None] | None = None,
        stream: str | None = None,
    ) -> None:
        timings = getattr(fields.get(JobField.RESULT), "timings", None)
        ttft_s = getattr(timings, "ttft_s", None)
        if status is JobStatus.SUCCEEDED and ttft_s is not None:
            self.ttfts.add(job_id, ttft_s)
        super().finish(job_id, entry_id, status, fields, on_done, stream)
