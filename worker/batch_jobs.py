"""The jobs of one worker's engine as a `Batch` (worker.batch) holds them: which are in the engine
or waiting to join it, the aborts asked for, the outcome counts, and the ways a job leaves (out
of the engine to rejoin, refused, dead-lettered, failed, ended). The phases build on it:
worker.batch_admission (between steps), worker.batch_failures (a step that raised) and
worker.batch (after a step).

Every method here touches the engine and must run while no step is in flight."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from enum import Enum

from schemas import (
    ErrorBody,
    JobField,
    JobStatus,
)
from worker.chunking import ChunkPolicy, take_chunks
from worker.engine_api import EngineLike
from worker.heartbeat import TtftBuffer
from worker.held import HeldJob
from worker.intake import Reject
from worker.logs import log_event
from worker.lora import AdapterRegistry
from worker.metrics import WorkerMetrics
from worker.publisher import Outbox
from worker.step_failures import Bisect
from worker.tracing import ChunkTracer

logger = logging.getLogger(__name__)

ESTIMATE_WEIGHT = 0.2  # how fast the assumed job size follows the jobs actually seen


class AbortReason(Enum):
    ENDED = "ended"  # cancelled / ended elsewhere: the hash says so already; just ack
    LOST = "lost"  # another worker owns the entry now: stop quietly
    DEADLINE = "deadline"  # deadline passed while running: mark expired


class HeldJobs:
    """The jobs of one worker's engine and how each leaves it (see the module's docstring)."""

    def __init__(
        self,
        engine: EngineLike,
        outbox: Outbox,
        *,
        worker_name: str,
        policy: ChunkPolicy,
        metrics: WorkerMetrics,
        tracer: ChunkTracer,
        prompt_estimate: int,
        lora: AdapterRegistry | None = None,
    ) -> None:
        self.engine = engine
        self.lora = lora or AdapterRegistry({})  # the LoRA adapters it serves, by name
        self.outbox = outbox
        self.worker_name = worker_name
        self.policy = policy
        self.metrics = metrics
        self.tracer = tracer
        self.ttfts = TtftBuffer()
        self.held: dict[str, HeldJob] = {}  # admitted: in the engine, or out after a failed step
        self.ready: list[HeldJob] = []  # read from the stream, added to the engine next turn
        self.outcomes: dict[str, int] = {}
        self._aborts: dict[str, AbortReason] = {}
        self._buffered: set[str] = set()  # jobs with output held back by chunk coalescing
        # when the last step's output was collected: about when the next step began, which is
        # when its tokens count as made (a step longer than the chunk interval then publishes
        # every step, and coalescing adds at most the interval to a client's wait)
        self._last_collected: float | None = None
        # jobs joined the engine this turn: their start and first-step marker must reach Redis
        # before the step (see worker.crashes); the worker sends those ops first and clears it
        self.first_step_unsent = False
        self._first_step: list[str] = []  # jobs whose first step in this start is the next one
        self._marked = False  # the outbox holds a first-step marker to delete after the step
        self._bisect: Bisect | None = None
        self._unexplained = 0  # searches in a row that reproduced no failure
        # the most jobs in the engine after it ran out of memory (None: no limit)
        self.engine_cap: int | None = None
        self._prompt_estimate = float(prompt_estimate)
        self._max_tokens_estimate = 16.0
        self._inputs_estimate = 1.0  # sequences per job: an embedding job may have several

    # ------------------------------------------------------------------ bookkeeping

    def holds(self, job_id: str) -> bool:
        return job_id in self.held or any(h.job_id == job_id for h in self.ready)

    def all_jobs(self) -> list[HeldJob]:
        return [*self.held.values(), *self.ready]

    def queue(self, held: HeldJob) -> None:
        if not self.holds(held.job_id):
            self.ready.append(held)
            # learnt as jobs are read, so the next read is sized by it
            inputs = held.job.request.input_count
            self._inputs_estimate += ESTIMATE_WEIGHT * (inputs - self._inputs_estimate)

    def request_abort(self, job_id: str, reason: AbortReason) -> None:
        """Abort at the start of the next turn (safe to call while a step runs)."""
        if self.holds(job_id):
            self._aborts.setdefault(job_id, reason)

    def count(self, outcome: str, amount: int = 1) -> None:
        if amount:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + amount
            self.metrics.requests.labels(self.metrics.model, outcome).inc(amount)

    def reject(self, verdict: Reject) -> None:
        """Dead-letter an entry and fail its job."""
        job_id, entry_id, error = verdict.job_id, verdict.entry_id, verdict.error
        log_error(logging.WARNING, "job_dead_lettered", job_id, error, entry=entry_id)
        self.outbox.fail(
            job_id, entry_id, error, verdict.entry_fields, verdict.attempts, verdict.stream
        )
        self.count("dead_lettered")

    # ------------------------------------------------------------------ how a job leaves

    def _park(self, held: HeldJob) -> None:
        """Out of the engine, to rejoin later from the output it has produced so far."""
        self._abort_in_engine(held.job_id)
        held.in_engine = False
        held.fold_run_output()

    def _refuse(self, held: HeldJob, error: ErrorBody) -> None:
        log_error(logging.INFO, "job_refused", held.job_id, error)
        self._finish_with_error(held, error)

    def _dead_letter(self, held: HeldJob, error: ErrorBody) -> None:
        fields = {"job": held.job_id}
        attempts = held.job.attempts
        self.reject(Reject(held.entry_id, held.job_id, error, fields, attempts, held.queue_stream))

    def _abort_in_engine(self, job_id: str) -> None:
        try:
            self.engine.abort(job_id)
        except Exception:
            logger.exception("engine abort of %s failed", job_id)

    def _finish_with_error(
        self, held: HeldJob, error: ErrorBody, status: JobStatus = JobStatus.FAILED
    ) -> None:
        """End the job as `status` (failed or expired) with `error`, counted by that status."""
        self._end(held, status, {JobField.ERROR: error})
        self.count(status.value)

    def _end(
        self,
        held: HeldJob,
        status: JobStatus,
        fields: dict[str, object],
        on_done: Callable[[bool, JobStatus | None], None] | None = None,
    ) -> None:
        self.outbox.finish(
            held.job_id, held.entry_id, status, fields, on_done, stream=held.queue_stream
        )
        if held.batch_id is not None:
            self.outbox.announce_batch_end(held.batch_id, held.job_id)

    def _fail_with_final_chunk(self, held: HeldJob, error: ErrorBody) -> None:
        """Fail a job no longer in `held`, with a final `error` chunk for streaming readers."""
        self._buffered.discard(held.job_id)
        for choice in held.choices:
            choice.finish_reason = choice.finish_reason or "error"
        for chunk in take_chunks(held, self.policy, time.monotonic(), force=True):
            self.outbox.chunk(chunk)
        self._finish_with_error(held, error)


def log_error(
    level: int, event: str, job_id: str | None, error: ErrorBody, **fields: object
) -> None:
    code, message = error.code.value, error.message
    log_event(logger, level, event, job=job_id, **fields, code=code, message=message)
