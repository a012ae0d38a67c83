"""Between engine steps: deadlines and aborts applied, jobs parked by a failed step rejoining,
the jobs read last turn admitted into the engine (their prompts tokenized, refused or
dead-lettered when the engine would not take them), and how many more the engine has room to
pull.

Every method here touches the engine and must run while no step is in flight."""

from __future__ import annotations

import logging

from engine.errors import RequestRejectedError
from engine.outputs import EngineRequest
from schemas import (
    ErrorBody,
    ErrorCode,
    JobField,
    JobRequest,
    JobStatus,
    RunState,
    utc_now,
)
from worker.batch_jobs import ESTIMATE_WEIGHT, AbortReason, HeldJobs
from worker.held import HeldJob
from worker.logs import log_event

logger = logging.getLogger(__name__)


class Admission(HeldJobs):
    """Between steps, what joins and leaves the engine (see the module's docstring)."""

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
        w = ESTIMATE_WEIGHT
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
