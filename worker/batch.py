"""The engine side of a worker: which jobs are in the engine, how many more it admits, and
turning each step's deltas into chunks, results and status changes queued in the outbox. A
step that raises is answered by worker.step_failures' search, which leaves the jobs it did not
find at fault running.

Every method here touches the engine and must run while no step is in flight."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime
from enum import Enum

from engine.errors import RequestRejectedError
from engine.lora.request import LORA_FAILURE_PREFIX
from engine.outputs import EngineRequest, RequestDelta, RequestOutput
from schemas import (
    ErrorBody,
    ErrorCode,
    Job,
    JobField,
    JobRequest,
    JobResult,
    JobStatus,
    RunState,
    Timings,
    utc_now,
)
from schemas.workers import TtftSample
from worker.chunking import ChunkPolicy, absorb, take_chunks
from worker.engine_api import EngineLike
from worker.heartbeat import TtftBuffer
from worker.held import HeldJob
from worker.intake import Reject
from worker.logs import log_event
from worker.lora import AdapterRegistry
from worker.metrics import WorkerMetrics
from worker.publisher import Outbox
from worker.results import job_result
from worker.step_failures import MAX_UNEXPLAINED_FAILURES, Bisect, is_out_of_memory
from worker.tracing import ChunkTracer

logger = logging.getLogger(__name__)

_ESTIMATE_WEIGHT = 0.2  # how fast the assumed job size follows the jobs actually seen


class AbortReason(Enum):
    ENDED = "ended"  # cancelled / ended elsewhere: the hash says so already; just ack
    LOST = "lost"  # another worker owns the entry now: stop quietly
    DEADLINE = "deadline"  # deadline passed while running: mark expired


class Batch:
    """The jobs of one worker's engine, from `queue()` to result, abort or hand-back.

    The latency samples of succeeded jobs wait in `ttfts` for the next heartbeat
    (worker.heartbeat), so noting them adds no command to the step's pipeline."""

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
            self._inputs_estimate += _ESTIMATE_WEIGHT * (inputs - self._inputs_estimate)

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
        _log_error(logging.WARNING, "job_dead_lettered", job_id, error, entry=entry_id)
        self.outbox.fail(
            job_id, entry_id, error, verdict.entry_fields, verdict.attempts, verdict.stream
        )
        self.count("dead_lettered")

    # ------------------------------------------------------------------ between steps

    def prepare_turn(self) -> None:
        """Deadlines, aborts, jobs out of the engine after a failed step back in, then the
        jobs read last turn; the first-step marker of the newcomers into the outbox."""
        now = utc_now()
        for held in self.held.values():
            if held.job.request.is_past_deadline(now):
                self._aborts.setdefault(held.job_id, AbortReason.DEADLINE)
        self._apply_aborts()
        with self.outbox.ahead():  # sent before the step; the last step's results beside it
            self._rejoin_parked()
            if not self._bisect and not self._parked():
                self._admit_ready()
            if self._first_step:
                self.outbox.mark_first_step(self._first_step)
                self._first_step = []
                self._marked = True
                self.first_step_unsent = True

    def _parked(self) -> list[HeldJob]:
        return [h for h in self.held.values() if not h.in_engine]

    def _room(self) -> int | None:
        """How many more jobs the engine takes under `engine_cap` (None: no limit)."""
        if self.engine_cap is None:
            return None
        return max(0, self.engine_cap - sum(h.in_engine for h in self.held.values()))

    def pull_budget(self, max_pull: int) -> int:
        """How many more jobs the engine admits now (free KV blocks and sequence slots, minus
        what waiting requests will take), sized like the jobs seen so far: the engine counts
        sequences, and a job of several inputs runs one per input."""
        admissible = self.engine.num_admissible(
            max(1, round(self._prompt_estimate)), max(1, round(self._max_tokens_estimate))
        )
        admissible -= sum(h.job.request.input_count for h in self.ready)
        if self._inputs_estimate > 1:
            admissible = int(admissible // self._inputs_estimate)
        if self._quarantine_holds_admission() or self._bisect or self._parked():
            return 0  # whoever was read would wait; leave them to other workers
        room = self._room()
        if room is not None:
            admissible = min(admissible, room - len(self.ready))
        if admissible <= 0 and not self.engine.has_unfinished() and not self.ready:
            admissible = 1  # an idle engine always tries one job, whatever the estimate says
        return max(0, min(admissible, max_pull))

    def _quarantine_holds_admission(self) -> bool:
        """A quarantined job runs as the only job in the engine that has not made progress in
        its run yet: while one waits for that, or runs without progress, nothing joins."""
        return any(h.quarantined for h in self.ready) or any(
            h.quarantined and not h.progressed for h in self.held.values()
        )

    def _admissions(self) -> list[HeldJob]:
        """The ready jobs that join the engine now; the rest stay ready."""
        waiting = [h for h in self.ready if h.quarantined]
        if self._room() == 0 or any(h.quarantined and not h.progressed for h in self.held.values()):
            return []
        if not waiting:
            room = self._room()
            return self.ready if room is None else self.ready[: max(room, 0)]
        if all(h.progressed for h in self.held.values()):
            # the least-charged first: unlucky deaths spread over the suspects (worker.crashes)
            return [min(waiting, key=lambda h: h.job.attempts - h.crash_resumes)]
        return []  # the engine's newcomers make progress first (no new ones meanwhile)

    def _admit_ready(self) -> None:
        ready = self._admissions()
        joining = {id(h) for h in ready}
        self.ready = [h for h in self.ready if id(h) not in joining]
        for held in ready:
            request = held.job.request
            lora_request = None
            if request.lora is not None:
                lora_request = self.lora.request_for(request.lora)
                if lora_request is None:
                    message = f"model: this worker serves no LoRA adapter {request.lora!r}"
                    self._refuse(held, ErrorBody.of(ErrorCode.INVALID_LORA_ADAPTER, message))
                    continue
            try:
                input_ids = self._input_ids(request)
                prompt_ids, token_types = ([], None) if input_ids else self._prompt_ids(request)
                self.engine.add_request(
                    EngineRequest(
                        held.job_id,
                        prompt_ids,
                        request.sampling,
                        priority=request.priority,
                        prior_output_token_ids=held.prior_output_token_ids,
                        pooling=request.pooling,
                        token_type_ids=token_types,
                        inputs=input_ids,
                        lora_request=lora_request,
                    )
                )
            except RequestRejectedError as exc:
                if exc.caused_by_request:
                    # The client's mistake (too long once templated, a bad token id): the job
                    # fails with the engine's code; dead letters stay for what we got wrong.
                    self._refuse(held, ErrorBody.of(ErrorCode(exc.code), str(exc)))
                else:
                    self._dead_letter(held, ErrorBody.of(ErrorCode(exc.code), str(exc)))
                continue
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                self._dead_letter(held, ErrorBody.of(ErrorCode.ENGINE_ERROR, error))
                continue
            held.prompt_len = sum(map(len, input_ids)) if input_ids else len(prompt_ids)
            held.prompt_ids = prompt_ids
            held.input_ids = input_ids
            held.token_type_ids = token_types
            held.in_engine = True
            held.started_at = utc_now()
            self.held[held.job_id] = held
            self._first_step.append(held.job_id)
            per_input = held.prompt_len / request.input_count
            self._learn_size(per_input, request.sampling.max_tokens)
            self._start(held)

    def _rejoin_parked(self) -> None:
        """Jobs out of the engine after a failed step back in: the search's next probe group
        while it runs, else all of them (as many as `engine_cap` lets)."""
        parked = self._parked()
        if not parked:
            if self._bisect is not None and not self._bisect.probe:
                self._bisect = None  # every suspect ended meanwhile
            return
        if self._bisect is not None:
            probe = set(self._bisect.next_probe(self.held, self.engine_cap))
            if probe:
                parked = [h for h in parked if h.job_id in probe]
            else:
                self._bisect = None
        room = self._room()
        for held in parked if room is None else parked[:room]:
            request = held.job.request
            try:
                self.engine.add_request(
                    EngineRequest(
                        held.job_id,
                        held.prompt_ids or [],
                        request.sampling,
                        priority=request.priority,
                        prior_output_token_ids=held.prior_output_token_ids,
                        pooling=request.pooling,
                        token_type_ids=held.token_type_ids,
                        inputs=held.input_ids,
                    )
                )
            except Exception as exc:
                del self.held[held.job_id]
                error = ErrorBody.of(
                    ErrorCode.ENGINE_ERROR, f"the engine refused the job back: {exc}"
                )
                self._fail_with_final_chunk(held, error)
                continue
            held.in_engine = True
            if not held.progressed:
                self._first_step.append(held.job_id)

    def _park(self, held: HeldJob) -> None:
        """Out of the engine, to rejoin later from the output it has produced so far."""
        self._abort_in_engine(held.job_id)
        held.in_engine = False
        held.fold_run_output()

    def _refuse(self, held: HeldJob, error: ErrorBody) -> None:
        _log_error(logging.INFO, "job_refused", held.job_id, error)
        self._finish_with_error(held, error)

    def _dead_letter(self, held: HeldJob, error: ErrorBody) -> None:
        fields = {"job": held.job_id}
        attempts = held.job.attempts
        self.reject(Reject(held.entry_id, held.job_id, error, fields, attempts, held.queue_stream))

    def _prompt_ids(self, request: JobRequest) -> tuple[list[int], list[int] | None]:
        """The prompt's token ids, and a text pair's token types (None for one input)."""
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids), None
        if request.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in request.messages]
            return self.engine.apply_chat_template(messages), None
        if request.prompt_pair is not None:
            return self.engine.tokenize_pair(request.prompt or "", request.prompt_pair)
        return self.engine.tokenize(request.prompt or ""), None

    def _input_ids(self, request: JobRequest) -> list[list[int]] | None:
        """Each input's token ids, for a job of several inputs (None for one input)."""
        if request.inputs is None:
            return None
        return [
            self.engine.tokenize(item) if isinstance(item, str) else list(item)
            for item in request.inputs
        ]

    def _learn_size(self, prompt_len: float, max_tokens: int) -> None:
        """Follow the size of the jobs seen: tokens per sequence (an input of a job of several
        inputs is a sequence), and tokens generated."""
        w = _ESTIMATE_WEIGHT
        self._prompt_estimate += w * (prompt_len - self._prompt_estimate)
        self._max_tokens_estimate += w * (max_tokens - self._max_tokens_estimate)

    def _start(self, held: HeldJob) -> None:
        fields: dict[str, object] = {
            JobField.WORKER: self.worker_name,
            JobField.ATTEMPTS: held.job.attempts + 1,
            JobField.CRASH_RESUMES: held.crash_resumes,
            JobField.RUN_STATE: RunState.STARTED,
        }
        if held.job.started_at is None:
            fields[JobField.STARTED_AT] = held.started_at  # queue wait counts from the first start

        def started(applied: bool, current: JobStatus | None) -> None:
            held.start_confirmed = applied
            if not applied and self.held.get(held.job_id) is held:
                self._aborts.setdefault(held.job_id, AbortReason.ENDED)

        self.outbox.transition(held.job_id, JobStatus.RUNNING, fields, started)
        log_event(
            logger,
            logging.DEBUG,
            "job_started",
            job=held.job_id,
            prompt_tokens=held.prompt_len,
            resumed_at_chunk=held.next_index,
            attempt=held.job.attempts + 1,
            quarantined=held.quarantined,
        )

    def _apply_aborts(self) -> None:
        if not self._aborts:
            return
        aborts, self._aborts = self._aborts, {}
        for job_id, reason in aborts.items():
            held = self.held.pop(job_id, None)
            if held is not None:
                self._abort_in_engine(job_id)
            else:
                held = next((h for h in self.ready if h.job_id == job_id), None)
                if held is None:
                    continue
                self.ready.remove(held)
            self._buffered.discard(job_id)
            log_event(logger, logging.INFO, "job_aborted", job=job_id, reason=reason.value)
            if reason is AbortReason.ENDED:
                self.outbox.ack(held.entry_id, held.queue_stream)
                self.count("cancelled")
            elif reason is AbortReason.DEADLINE:
                error = ErrorBody.of(
                    ErrorCode.DEADLINE_EXCEEDED, "the deadline passed while running"
                )
                self._finish_with_error(held, error, JobStatus.EXPIRED)
            else:
                self.count("lost")

    def _abort_in_engine(self, job_id: str) -> None:
        try:
            self.engine.abort(job_id)
        except Exception:
            logger.exception("engine abort of %s failed", job_id)

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
            _log_error(logging.INFO, "job_refused", held.job_id, error)
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

    # ------------------------------------------------------------------ failed steps

    def _step_passed(self) -> None:
        bisect = self._bisect
        if bisect is None:
            if all(h.in_engine for h in self.held.values()):
                self._unexplained = 0
            return
        probe = [self.held[j] for j in bisect.probe if j in self.held]
        if bisect.probe_passed():
            self._unexplained += 1
            self._bisect = None
            log_event(
                logger,
                logging.WARNING,
                "engine_error_not_reproduced",
                steps=bisect.steps,
                error=bisect.error,
            )
            return
        for held in probe:
            self._park(held)

    def _step_failed(self, error: BaseException) -> None:
        """A step raised (see worker.step_failures): its jobs leave the engine and are searched
        for the one at fault, or rejoin fewer at a time after running out of memory."""
        stepped = [h for h in self.held.values() if h.in_engine]
        for held in stepped:
            self._park(held)
        text = f"{type(error).__name__}: {error}"
        if is_out_of_memory(error):
            self._out_of_memory(stepped, text)
            return
        bisect = self._bisect
        if bisect is None:
            if self._unexplained >= MAX_UNEXPLAINED_FAILURES:
                self._unexplained = 0
                logger.error(
                    "engine step failed again after %d searches found no job at fault; "
                    "failing its %d jobs",
                    MAX_UNEXPLAINED_FAILURES,
                    len(stepped),
                    exc_info=error,
                )
                body = ErrorBody.of(ErrorCode.ENGINE_ERROR, f"the engine failed: {text}")
                for held in stepped:
                    del self.held[held.job_id]
                    self._fail_with_final_chunk(held, body)
                return
            self._bisect = Bisect(text, [h.job_id for h in stepped])
            logger.warning(
                "engine step failed; searching its %d jobs for the one at fault",
                len(stepped),
                exc_info=error,
            )
            return
        culprit = bisect.probe_failed()
        if culprit is None:
            return
        self._bisect = None
        held = self.held.pop(culprit)
        log_event(
            logger, logging.WARNING, "engine_error_reproduced", job=culprit, steps=bisect.steps
        )
        body = ErrorBody.of(ErrorCode.ENGINE_ERROR, f"the engine failed on this job: {text}")
        self._fail_with_final_chunk(held, body)

    def _out_of_memory(self, stepped: list[HeldJob], text: str) -> None:
        if len(stepped) == 1:
            held = stepped[0]
            del self.held[held.job_id]
            body = ErrorBody.of(
                ErrorCode.ENGINE_ERROR, f"the engine ran out of memory with this job alone: {text}"
            )
            self._fail_with_final_chunk(held, body)
            return
        self.engine_cap = max(1, len(stepped) // 2)
        if self._bisect is not None:
            self._bisect.probe = []  # a smaller probe group next
        log_event(
            logger,
            logging.WARNING,
            "engine_out_of_memory",
            jobs=len(stepped),
            engine_cap=self.engine_cap,
            error=text,
        )

    def _fail_with_final_chunk(self, held: HeldJob, error: ErrorBody) -> None:
        """Fail a job no longer in `held`, with a final `error` chunk for streaming readers."""
        self._buffered.discard(held.job_id)
        for choice in held.choices:
            choice.finish_reason = choice.finish_reason or "error"
        for chunk in take_chunks(held, self.policy, time.monotonic(), force=True):
            self.outbox.chunk(chunk)
        self._finish_with_error(held, error)

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


def _log_error(
    level: int, event: str, job_id: str | None, error: ErrorBody, **fields: object
) -> None:
    code, message = error.code.value, error.message
    log_event(logger, level, event, job=job_id, **fields, code=code, message=message)
