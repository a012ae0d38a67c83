"""The engine side of a worker: which jobs are in the engine, how many more it admits, and
turning each step's deltas into chunks, results and status changes queued in the outbox. The
jobs held and how each leaves live in worker.batch_jobs; admission between steps in
worker.batch_admission; a step that raises is answered by worker.batch_failures' search, which
leaves the jobs it did not find at fault running. Here: what a step's output becomes, and the
hand-back at shutdown.

Every method here touches the engine and must run while no step is in flight."""

from __future__ import annotations

import logging
import time
from datetime import datetime

from engine.lora.request import LORA_FAILURE_PREFIX
from engine.outputs import RequestDelta, RequestOutput
from schemas import (
    ErrorBody,
    ErrorCode,
    Job,
    JobField,
    JobResult,
    JobStatus,
    RunState,
    Timings,
    utc_now,
)
from schemas.workers import TtftSample
from worker.batch_admission import Admission
from worker.batch_failures import FailedSteps
from worker.batch_jobs import log_error
from worker.chunking import absorb, take_chunks
from worker.held import HeldJob
from worker.logs import log_event
from worker.results import job_result

logger = logging.getLogger(__name__)


class Batch(Admission, FailedSteps):
    """The jobs of one worker's engine, from `queue()` to result, abort or hand-back.

    The latency samples of succeeded jobs wait in `ttfts` for the next heartbeat
    (worker.heartbeat), so noting them adds no command to the step's pipeline."""

    # ------------------------------------------------------------------ after a step

    def collect(
        self, deltas: list[RequestDelta], error: BaseException | None, emitted_at: float
    ) -> None:
        """Queue the chunks due after a step, and the results of the jobs it finished."""
        if self._marked:
            with self.outbox.ahead():  # before the next step's marker, which it must not delete
                self.outbox.clear_first_step()
            self._marked = False
        if error is not None:
            self._step_failed(error)
            return
        now = time.monotonic()
        made = now if self._last_collected is None else self._last_collected
        self._last_collected = now
        wall = utc_now()
        touched: dict[str, HeldJob] = {}
        finished: list[tuple[HeldJob, RequestOutput]] = []
        for delta in deltas:
            held = self.held.get(delta.request_id)
            if held is None:
                continue
            absorb(held, delta, made)
            if not held.progressed and (delta.token_ids or delta.finish_reason):
                # a job that ends in this step needs no mark: its result goes out in the
                # same flush and ends the start (a pooling job always does)
                self._mark_progress(held, stored=delta.output is None)
            if delta.token_ids and held.first_token_at is None and not held.resumed:
                held.first_token_at = wall
            touched[held.job_id] = held
            if delta.output is not None:
                finished.append((held, delta.output))
        coalescing = not self.policy.every_step
        if coalescing:
            touched.update((i, self.held[i]) for i in self._buffered if i in self.held)
        for held in touched.values():
            watched = self.outbox.listeners.publishes(held.job_id)
            for chunk in take_chunks(held, self.policy, now, watched=watched):
                self.outbox.chunk(chunk, set_ttl=chunk.final or not held.ttl_set)
                held.ttl_set = True
                self.tracer.emit(chunk.job_id, chunk.index, emitted_at)
            if coalescing:
                if any(c.pending_token_ids for c in held.choices):
                    self._buffered.add(held.job_id)
                else:
                    self._buffered.discard(held.job_id)
        for held, output in finished:
            self._complete(held, output, wall)
        self.tracer.flush()
        self._step_passed()

    def _mark_progress(self, held: HeldJob, *, stored: bool = True) -> None:
        """Record that this start got past the job's first step: if the worker dies now, the
        job rode along (worker.crashes). Running -> running, so a job that ended meanwhile
        is left alone. `stored=False` notes it here only."""
        held.progressed = True
        if not stored:
            return
        self.outbox.transition(
            held.job_id, JobStatus.RUNNING, {JobField.RUN_STATE: RunState.PROGRESSED}
        )

    def _complete(self, held: HeldJob, output: RequestOutput, wall: datetime) -> None:
        del self.held[held.job_id]
        self._buffered.discard(held.job_id)
        adapter_failure = _adapter_failure(held, output)
        if adapter_failure is not None:  # its adapter could not load: this job alone fails
            error = ErrorBody.of(ErrorCode.INVALID_LORA_ADAPTER, adapter_failure)
            log_error(logging.INFO, "job_refused", held.job_id, error)
            self._finish_with_error(held, error)
            return
        try:
            timings = Timings.from_times(
                queued_at=held.job.created_at,
                started_at=held.job.started_at or held.started_at,
                first_token_at=held.first_token_at,
                finished_at=wall,
            )
            result = job_result(output, timings, held.choices)
        except Exception as exc:  # an output the schema refuses is an engine bug
            logger.exception("no result for %s", held.job_id)
            self._finish_with_error(
                held, ErrorBody.of(ErrorCode.ENGINE_ERROR, f"invalid engine output: {exc}")
            )
            return

        def stored(applied: bool, current: JobStatus | None) -> None:
            if not applied and current is not JobStatus.SUCCEEDED:
                log_event(logger, logging.INFO, "result_dropped", job=held.job_id, status=current)

        self._end(held, JobStatus.SUCCEEDED, {JobField.RESULT: result}, stored)
        self.count("succeeded")
        self._observe_timings(held.job, result)
        if self.engine_cap is not None:
            self.engine_cap += 1  # feel for the size that fits again, one job at a time

    def _observe_timings(self, job: Job, result: JobResult) -> None:
        t, m = result.timings, self.metrics.model
        sample = TtftSample.of_result(job.id, job.request.priority, result)
        if sample is not None:
            self.ttfts.add(sample)
        if t.ttft_s is not None:
            self.metrics.ttft.labels(m).observe(t.ttft_s)
        if t.queue_wait_s is not None:
            self.metrics.queue_wait.labels(m).observe(t.queue_wait_s)
        if t.total_s is not None:
            self.metrics.e2e.labels(m).observe(t.total_s)
        generated = max(len(c.token_ids) for c in result.choices)
        if t.decode_s is not None and generated > 1:
            self.metrics.tpot.labels(m).observe(t.decode_s / (generated - 1))

    # ------------------------------------------------------------------ shutdown

    def release_for_hand_back(self) -> list[HeldJob]:
        """Abort everything, queue the output produced so far, return the jobs to re-queue."""
        now = time.monotonic()
        jobs = self.all_jobs()
        for held in self.held.values():
            self._abort_in_engine(held.job_id)
            for chunk in take_chunks(held, self.policy, now, force=True):
                self.outbox.chunk(chunk)
        self.held.clear()
        self.ready = []
        self._buffered.clear()
        self._bisect = None
        return jobs


def _adapter_failure(held: HeldJob, output: RequestOutput) -> str | None:
    """Why the job's LoRA adapter could not load, when that is how the engine finished it:
    every choice ended with "error" before any token, the reason naming the adapter."""
    if held.job.request.lora is None or not output.outputs:
        return None
    reasons = {c.stop_reason for c in output.outputs if c.finish_reason == "error"}
    if len(reasons) != 1 or any(c.token_ids for c in output.outputs):
        return None
    reason = reasons.pop()
    every_choice = len(output.outputs) == sum(c.finish_reason == "error" for c in output.outputs)
    if every_choice and isinstance(reason, str) and reason.startswith(LORA_FAILURE_PREFIX):
        return reason
    return None
