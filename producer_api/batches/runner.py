"""One controller run over a batch: validate, fan lines out into the model's bulk stream
(throttled by that stream's backlog), collect finished jobs into output / error lines, and
finalize. Every step is idempotent, so a run killed at any point is simply run again:

- a line whose prompt the model's workers would refuse (producer_api.prompt_check) goes to the
  error file instead of the queue;
- a line's job is enqueued with the idempotency key `{batch_id}:{line}`: enqueueing it again
  returns the same job, never a second one; embedding lines run in groups, one job of several
  inputs each, formed the same way by every run and keyed by their first line
  (producer_api.batches.groups); a group whose job fails runs its lines again one job each, so
  one bad input fails its line alone;
- a finished line is written to `:out` / `:err` keyed by its line number: writing it twice
  leaves one line;
- output files get ids derived from the batch id: finalizing twice overwrites the same file.

Only one run advances a batch at a time (`Lease`); a run that dies leaves the lease to expire,
and the controller's resumer starts a new run.

Memory follows the lines in flight, not the file (producer_api.batches.input_lines).
Validation parses each line once and stores the invalid lines' numbers (`invalid_lines`), so
later runs find the valid ones without parsing the file again."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis

from producer_api import queue
from producer_api.batches.enqueue_all import enqueue_all
from producer_api.batches.files import FileStore
from producer_api.batches.groups import (
    LineGroup,
    carried_lines,
    group_output_lines,
    group_request,
    groups_of,
)
from producer_api.batches.input_lines import InputLines
from producer_api.batches.lease_holder import holder_token
from producer_api.batches.lines import (
    EMBEDDINGS,
    ParsedLine,
    batch_job_request,
    line_not_run,
    line_of_error,
    line_of_result,
    prompt_param,
)
from producer_api.batches.output_files import WrittenFile, write_lines_file
from producer_api.batches.settings import BatchControllerSettings
from producer_api.batches.store import BatchStore, now_s
from producer_api.errors import ApiError
from producer_api.lora import on_base_model
from producer_api.prompt_check import PromptLimits, check_prompt, prompt_limits
from producer_api.prompt_tokens import TokenizerCache
from producer_api.workers import WorkerDirectory
from redis_io.clients import pipeline
from redis_io.scripts import run_script
from schemas import (
    TERMINAL_STATUSES,
    BatchField,
    BatchStatus,
    ErrorCode,
    Job,
    JobField,
    JobRequest,
    JobStatus,
    RedisKeys,
)
from schemas.batches import BATCH_ID_PREFIX
from schemas.redis_scripts import LEASE_RELEASE_SCRIPT, LEASE_RENEW_SCRIPT

log = logging.getLogger(__name__)

CANCELLED_CODE = "batch_cancelled"
EXPIRED_CODE = "batch_expired"
NOT_RUN_CODES = (CANCELLED_CODE, EXPIRED_CODE)
_COLLECT_CHUNK = 500
_ERROR_WRITE_CHUNK = 1000  # error lines written per round trip while validating or stopping
_FAILURE_DETAILS = 10  # invalid lines named in a failed batch's errors
# a group's job ended so (or succeeded without a vector per line): its lines run again alone
_RETRIED_GROUP_STATUSES = frozenset({JobStatus.FAILED, JobStatus.SUCCEEDED})


class Lease:
    """`SET NX PX` on the batch's lease key: who holds it advances the batch."""

    def __init__(self, redis: Redis, key: str, ttl_s: float) -> None:
        self.redis = redis
        self.key = key
        self.ttl_ms = int(ttl_s * 1000)
        self.token = holder_token()

    async def acquire(self) -> bool:
        return bool(await self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms))

    async def renew(self) -> bool:
        renewed = await run_script(
            self.redis, LEASE_RENEW_SCRIPT, [self.key], [self.token, self.ttl_ms]
        )
        return bool(renewed)

    async def release(self) -> None:
        await run_script(self.redis, LEASE_RELEASE_SCRIPT, [self.key], [self.token])


def output_file_ids(batch_id: str) -> tuple[str, str]:
    """Deterministic ids of a batch's output and error files."""
    suffix = batch_id[len(BATCH_ID_PREFIX) :]
    return f"file-{suffix}-out", f"file-{suffix}-err"


class BatchRunner:
    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        settings: BatchControllerSettings,
        batch_id: str,
        tokenizers: TokenizerCache | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.batch_id = batch_id
        self.store = BatchStore(redis, keys)
        self.workers = WorkerDirectory(redis, keys)
        self.tokenizers = tokenizers or TokenizerCache()
        self.files = FileStore(redis, keys)
        self.outstanding: dict[int, str] = {}  # line number -> job id, not yet collected
        self.lines_of: dict[str, list[int]] = {}  # job id -> its line numbers, outstanding jobs
        self.group_lines = 1  # embedding lines per job, as the batch fixed it
        self._next_sweep = 0.0  # monotonic time every outstanding job's status is read next
        self.input = InputLines([], "", settings.default_max_tokens)
        self.submitted = 0  # valid lines fanned out (an index into `input.valid`)

    async def advance(self, until: float, lease: Lease) -> bool:
        """Work on the batch until it is over (True) or the monotonic time `until` (False)."""
        data = await self.store.raw(self.batch_id)
        if not data or BatchStatus(data[BatchField.STATUS]).is_terminal:
            await self._retire()
            return True
        self.owner = data.get(BatchField.OWNER) or None
        self.expires_at = int(data[BatchField.EXPIRES_AT])
        text = await self.files.content(data[BatchField.INPUT_FILE_ID])
        if text is None:
            return await self._fail("input_file_missing", "the input file no longer exists")
        self.input = InputLines(
            text.splitlines(), data[BatchField.ENDPOINT], self.settings.default_max_tokens
        )
        del text
        invalid = data.get(BatchField.INVALID_LINES)
        if data[BatchField.STATUS] == BatchStatus.VALIDATING or invalid is None:
            if not await self._validate(data[BatchField.STATUS] == BatchStatus.VALIDATING):
                return True
        else:
            self.input.skip(json.loads(invalid))
        await self._load_group_size()
        await self._load_progress()
        while True:
            status = await self.redis.hget(self.keys.batch(self.batch_id), BatchField.STATUS)
            if status == BatchStatus.CANCELLING:
                await self._stop(CANCELLED_CODE, "the batch was cancelled before this request ran")
                return await self._finalize(BatchStatus.CANCELLED)
            if now_s() >= self.expires_at:
                await self._stop(EXPIRED_CODE, "the batch expired before this request ran")
                return await self._finalize(BatchStatus.EXPIRED)
            # up to the backlog's room now, not one chunk a poll: that would cap the batch at
            # batch_chunk_lines / batch_poll_interval_s lines a second, whatever the workers do
            while await self._fan_out():
                pass
            await self._collect_announced()
            if time.monotonic() >= self._next_sweep:
                await self._sweep()
                reads = len(self.outstanding) / self.settings.batch_status_reads_per_s
                pause = max(self.settings.batch_sweep_interval_s, reads)
                self._next_sweep = time.monotonic() + pause
            if self.submitted >= len(self.input.valid) and not self.outstanding:
                return await self._finalize(BatchStatus.COMPLETED)
            await self._publish_counts()
            if time.monotonic() >= until or not await lease.renew():
                return False
            await asyncio.sleep(self.settings.batch_poll_interval_s)

    # ------------------------------------------------------------------ phases

    async def _validate(self, validating: bool) -> bool:
        """Parse every line once, keeping only the valid lines' numbers. While validating, bad
        lines go to the error file now and their numbers to the batch; False when nothing can
        run (the batch failed)."""
        errors: dict[int, str] = {}
        invalid: list[int] = []
        details: list[dict[str, Any]] = []
        total = 0
        for line in self.input.scan():
            total += 1
            if line.ok:
                continue
            invalid.append(line.number)
            assert line.error is not None
            if len(details) < _FAILURE_DETAILS and not self.input.valid:
                details.append(
                    {"code": line.error.code.value, "message": line.error.message,
                     "line": line.number}
                )  # fmt: skip
            if validating:
                errors[line.number] = line_of_error(line)
                if len(errors) >= _ERROR_WRITE_CHUNK:
                    await self.redis.hset(self.keys.batch_errors(self.batch_id), mapping=errors)
                    errors.clear()
        if not validating:  # a batch validated before invalid_lines was stored
            return True
        async with self.redis.pipeline(transaction=False) as pipe:
            if errors:
                pipe.hset(self.keys.batch_errors(self.batch_id), mapping=errors)
            pipe.hset(
                self.keys.batch(self.batch_id),
                mapping={BatchField.TOTAL: total, BatchField.INVALID_LINES: json.dumps(invalid)},
            )
            await pipe.execute()
        if not self.input.valid:
            await self._fail("invalid_input", "no line of the input file is valid", details)
            return False
        await self.store.set_status(
            self.batch_id, BatchStatus.IN_PROGRESS, (BatchStatus.VALIDATING,)
        )
        log.info("batch %s: %d lines, %d invalid", self.batch_id, total, len(invalid))
        return True

    async def _load_group_size(self) -> None:
        """How many embedding lines make one job: fixed by the batch's first run (a later run
        with other settings forms the same groups)."""
        if self.input.endpoint != EMBEDDINGS:
            return
        key = self.keys.batch(self.batch_id)
        size = min(self.settings.batch_embedding_group_lines, self.settings.batch_max_in_flight)
        await self.redis.hsetnx(key, BatchField.GROUP_LINES, str(size))
        self.group_lines = int(await self.redis.hget(key, BatchField.GROUP_LINES) or 1)

    async def _load_progress(self) -> None:
        """Where an earlier run stopped: lines enqueued, and the jobs not yet collected (a line
        leaves `batch_lines` with its output, so this reads the lines in flight, not the file)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(self.keys.batch(self.batch_id), BatchField.SUBMITTED)
            pipe.hgetall(self.keys.batch_lines(self.batch_id))
            submitted, line_jobs = await pipe.execute()
        self.submitted = int(submitted or 0)
        pending = {int(n): job for n, job in line_jobs.items()}
        written = await self._written(list(pending))
        if written:  # collected by a run that kept them here
            await self.redis.hdel(self.keys.batch_lines(self.batch_id), *written)
        self.outstanding = {n: job for n, job in pending.items() if n not in written}
        self.lines_of = {}
        for number, job in sorted(self.outstanding.items()):
            self.lines_of.setdefault(job, []).append(number)

    async def _written(self, numbers: list[int]) -> set[int]:
        """Those of the line `numbers` with an output or error line already."""
        written: set[int] = set()
        for start in range(0, len(numbers), _COLLECT_CHUNK):
            part = numbers[start : start + _COLLECT_CHUNK]
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hmget(self.keys.batch_outputs(self.batch_id), part)
                pipe.hmget(self.keys.batch_errors(self.batch_id), part)
                out, err = await pipe.execute()
            written.update(n for n, o, e in zip(part, out, err, strict=True) if o or e)
        return written

    async def _fan_out(self) -> bool:
        """Enqueue the next chunk of lines, as far as the backlog and in-flight caps leave room;
        False when there was none (or no line left)."""
        valid = self.input.valid
        if self.submitted >= len(valid):
            return False
        room = min(
            self.settings.batch_chunk_lines,
            self.settings.batch_max_in_flight - len(self.outstanding),
        )
        if room <= 0:
            return False
        model = self.input.line(valid[self.submitted]).request.model  # type: ignore[union-attr]
        backlog = await queue.queue_length(self.redis, self.keys, model, bulk=True)
        room = min(room, (self.settings.batch_max_backlog - backlog) * self.group_lines)
        if room <= 0:
            return False
        end = self._chunk_end(room)
        if end == self.submitted:
            return False
        chunk = [self.input.line(n) for n in valid[self.submitted : end]]
        refused = await self._refusals(chunk)
        runnable = [line for line in chunk if line.number not in refused]
        on_base = await self._on_base_models(runnable, refused)
        if self.group_lines > 1:
            groups = list(groups_of(chunk, self.submitted, self.group_lines, set(on_base)))
        else:
            groups = [LineGroup.alone(line) for line in runnable if line.number in on_base]
        enqueued = await self._enqueue(groups, on_base, refused, {ln.number for ln in chunk})
        async with pipeline(self.redis, atomic=True) as pipe:
            if enqueued:
                pipe.hset(self.keys.batch_lines(self.batch_id), mapping=enqueued)
            if refused:
                pipe.hset(self.keys.batch_errors(self.batch_id), mapping=refused)
            pipe.hset(self.keys.batch(self.batch_id), BatchField.SUBMITTED, end)
            await pipe.execute()
        self.submitted = end
        self.input.parsed.update((ln.number, ln) for ln in chunk if ln.number in enqueued)
        self._track(enqueued)
        return True

    def _chunk_end(self, room: int) -> int:
        """Where a chunk of up to `room` lines from `submitted` ends: at a group's end, so a
        group is never split between fan-out rounds. A group larger than the room waits for
        the lines in flight to end (then goes alone, past the room: never a deadlock)."""
        valid, size = len(self.input.valid), self.group_lines
        end = min(self.submitted + room, valid)
        if size == 1 or end == valid:
            return end
        aligned = end - end % size
        if aligned > self.submitted:
            return aligned
        if self.outstanding:
            return self.submitted
        return min(self.submitted - self.submitted % size + size, valid)

    def _track(self, enqueued: dict[int, str]) -> None:
        """Note lines now out as the jobs `enqueued` names (line number -> job id)."""
        self.outstanding.update(enqueued)
        for number, job_id in sorted(enqueued.items()):
            self.lines_of.setdefault(job_id, []).append(number)

    async def _enqueue(
        self,
        groups: list[LineGroup],
        requests: dict[int, JobRequest],
        refused: dict[int, str],
        ours: set[int],
    ) -> dict[int, str]:
        """Enqueue each group as one job (a group of one line: the line's own job); the job
        of each line (line number -> job id). A group's job enqueued by an earlier run is what
        it names: it carries the lines it names (whatever this run refused), and lines of the
        group it does not carry run one job each. Lines refused at enqueue join `refused`."""
        deadline = datetime.fromtimestamp(self.expires_at, UTC)
        enqueued: dict[int, str] = {}
        while groups:
            calls = [self._group_request(g, requests, deadline) for g in groups]
            results = await enqueue_all(
                self.redis,
                self.keys,
                calls,
                owner=self.owner,
                replicas=self.settings.replica_wait(),
            )
            leftovers: list[LineGroup] = []
            for group, result in zip(groups, results, strict=True):
                if isinstance(result, queue.QueueError):
                    code, message = result.code.value, result.error.message
                    refused.update(
                        (ln.number, line_not_run(ln, code, message)) for ln in group.lines
                    )
                elif isinstance(result, BaseException):
                    raise result  # Redis trouble: arq retries the run; enqueued lines dedupe
                else:
                    carried = carried_lines(result)
                    if carried is None:
                        enqueued[group.lines[0].number] = result.id
                        continue
                    for number in carried:
                        if number in ours:
                            enqueued[number] = result.id
                            refused.pop(number, None)
                    leftovers += [
                        LineGroup.alone(ln) for ln in group.lines if ln.number not in enqueued
                    ]
            groups = leftovers
        return enqueued

    def _group_request(
        self, group: LineGroup, requests: dict[int, JobRequest], deadline: datetime
    ) -> JobRequest:
        """The job of a group: several lines' inputs in one embedding job, or one line's job
        (the single-line path: a batch of generation lines, or a group's line run alone)."""
        if group.single:
            line = group.lines[0]
            return batch_job_request(
                requests[line.number], batch_id=self.batch_id, line=line, deadline=deadline
            )
        return group_request(
            group,
            [requests[line.number] for line in group.lines],
            batch_id=self.batch_id,
            deadline=deadline,
        )

    async def _on_base_models(
        self, lines: list[ParsedLine], refused: dict[int, str]
    ) -> dict[int, JobRequest]:
        """Each line's job request as queued: a LoRA adapter's runs on its base model
        (producer_api.lora); a line naming an adapter no live worker serves joins `refused`."""
        served = await self.workers.models()
        out: dict[int, JobRequest] = {}
        for line in lines:
            assert line.request is not None
            try:
                out[line.number] = on_base_model(line.request, served, "body.model")
            except ApiError as exc:
                refused[line.number] = line_not_run(line, exc.error.code.value, exc.error.message)
        return out

    async def _refusals(self, lines: list[ParsedLine]) -> dict[int, str]:
        """Error lines of the lines whose prompt the model's workers would refuse (a token id
        outside its vocabulary, too long for its context): they are never queued."""
        served = await self.workers.models()
        limits: dict[str, PromptLimits] = {}
        refused: dict[int, str] = {}
        for line in lines:
            request = line.request
            assert request is not None
            model = served.get(request.model)
            if request.model not in limits:
                context = model.max_model_len if model is not None else None
                limits[request.model] = await prompt_limits(model, context, self.tokenizers)
            try:
                await check_prompt(
                    request, limits[request.model], prompt_param(line), sampling_prefix="body."
                )
            except ApiError as exc:
                refused[line.number] = line_not_run(line, exc.error.code.value, exc.error.message)
        return refused

    async def _collect_announced(self) -> None:
        """Write the lines of the jobs whose workers announced their end since the last look."""
        key = self.keys.batch_ended(self.batch_id)
        while True:
            announced = await self.redis.lpop(key, _COLLECT_CHUNK)
            if not announced:
                return
            await self._collect([job for job in dict.fromkeys(announced) if job in self.lines_of])
            if len(announced) < _COLLECT_CHUNK:
                return

    async def _sweep(self, *, retry_groups: bool = True) -> None:
        """Every outstanding job's status: the ends no worker announced (a cancel, an expiry, a
        dead letter, a worker that died between a result and its announcement)."""
        await self._collect(list(self.lines_of), retry_groups=retry_groups)

    async def _collect(self, jobs: list[str], *, retry_groups: bool = True) -> None:
        """Write the lines of those of `jobs` that ended."""
        for start in range(0, len(jobs), _COLLECT_CHUNK):
            part = jobs[start : start + _COLLECT_CHUNK]
            async with self.redis.pipeline(transaction=False) as pipe:
                for job_id in part:
                    pipe.hget(self.keys.job(job_id), JobField.STATUS)
                statuses = await pipe.execute()
            ended = [
                job_id
                for job_id, status in zip(part, statuses, strict=True)
                if status is None or status in TERMINAL_STATUSES
            ]
            if ended:
                await self._write_ended(ended, retry_groups)

    async def _write_ended(self, ended: list[str], retry_groups: bool) -> None:
        """Each ended job's lines into the output or error file. The lines of a group whose
        job failed (or gave no vector per line) run again one job each, unless `retry_groups`
        is False (the batch is stopping): then each gets the group's error."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in ended:
                pipe.hgetall(self.keys.job(job_id))
            stored = await pipe.execute()
        out: dict[int, str] = {}
        err: dict[int, str] = {}
        again: list[LineGroup] = []
        for job_id, data in zip(ended, stored, strict=True):
            numbers = self.lines_of[job_id]
            if not data:
                message = f"the record of job {job_id} is gone"
                for number in numbers:
                    line = self.input.line(number)
                    err[number] = line_not_run(line, ErrorCode.INTERNAL_ERROR.value, message)
                continue
            job = Job.from_redis_hash(data)
            carried = carried_lines(job)
            if carried is None:
                succeeded, text = line_of_result(self.input.line(numbers[0]), job)
                (out if succeeded else err)[numbers[0]] = text
                continue
            lines = [self.input.line(number) for number in carried]
            texts = group_output_lines(lines, job)
            if texts is not None:
                out.update(zip(carried, texts, strict=True))
            elif retry_groups and len(lines) > 1 and job.status in _RETRIED_GROUP_STATUSES:
                log.info("batch %s: group job %s %s; its %d lines run one job each",
                         self.batch_id, job_id, job.status.value, len(lines))  # fmt: skip
                again += [LineGroup.alone(line) for line in lines]
            else:
                err.update((line.number, line_of_result(line, job)[1]) for line in lines)
        rerun: dict[int, str] = {}
        if again:
            requests = {
                line.number: line.request
                for group in again
                for line in group.lines
                if line.request is not None
            }
            rerun = await self._enqueue(again, requests, err, set(requests))
        finished = [n for job_id in ended for n in self.lines_of[job_id] if n not in rerun]
        async with pipeline(self.redis, atomic=True) as pipe:
            if out:
                pipe.hset(self.keys.batch_outputs(self.batch_id), mapping=out)
            if err:
                pipe.hset(self.keys.batch_errors(self.batch_id), mapping=err)
            if finished:
                pipe.hdel(self.keys.batch_lines(self.batch_id), *finished)
            if rerun:
                pipe.hset(self.keys.batch_lines(self.batch_id), mapping=rerun)
            await pipe.execute()
        for job_id in ended:
            self.lines_of.pop(job_id, None)
        for number in finished:
            self.outstanding.pop(number, None)
            self.input.parsed.pop(number, None)
        self._track(rerun)

    async def _publish_counts(self) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hlen(self.keys.batch_outputs(self.batch_id))
            pipe.hlen(self.keys.batch_errors(self.batch_id))
            completed, failed = await pipe.execute()
        await self.redis.hset(
            self.keys.batch(self.batch_id),
            mapping={BatchField.COMPLETED: completed, BatchField.FAILED: failed},
        )

    async def _stop(self, code: str, message: str) -> None:
        """Cancel the jobs still out (results already in stay), collect, and mark the lines
        never enqueued as not run. Jobs that finish meanwhile keep their output."""
        for job_id in list(self.lines_of):
            with contextlib.suppress(queue.JobNotFoundError):
                await queue.cancel_job(self.redis, self.keys, job_id, reason=message)
        await self._sweep(retry_groups=False)
        left = itertools.chain(
            self.input.valid_from(self.submitted), map(self.input.line, list(self.outstanding))
        )
        while part := list(itertools.islice(left, _ERROR_WRITE_CHUNK)):
            never_run = {line.number: line_not_run(line, code, message) for line in part}
            await self.redis.hset(self.keys.batch_errors(self.batch_id), mapping=never_run)
        self.outstanding.clear()
        self.lines_of.clear()
        self.input.parsed.clear()

    async def _fail(self, code: str, message: str, details: list | None = None) -> bool:
        errors = {"object": "list", "data": details or [{"code": code, "message": message}]}
        await self.redis.hset(self.keys.batch(self.batch_id), BatchField.ERRORS, json.dumps(errors))
        return await self._finalize(BatchStatus.FAILED)

    async def _finalize(self, final: BatchStatus) -> bool:
        """Write the output and error files, then the final status and counts (one MULTI with
        the clean-up, so a run killed here finalizes again from the same data)."""
        if final is BatchStatus.COMPLETED:
            applied, current = await self.store.set_status(
                self.batch_id, BatchStatus.FINALIZING, (BatchStatus.IN_PROGRESS,)
            )
            if not applied and current is BatchStatus.CANCELLING:
                return await self._finalize(BatchStatus.CANCELLED)  # every line is in already
        out_id, err_id = output_file_ids(self.batch_id)
        out = await self._save(out_id, "output", self.keys.batch_outputs(self.batch_id))
        err = await self._save(
            err_id, "errors", self.keys.batch_errors(self.batch_id), _count_failed
        )
        extra: dict[str, str | int] = {
            BatchField.COMPLETED: out.lines,
            BatchField.FAILED: err.counted,
        }
        if out.lines:
            extra[BatchField.OUTPUT_FILE_ID] = out_id
        if err.lines:
            extra[BatchField.ERROR_FILE_ID] = err_id
        allowed = tuple(s for s in BatchStatus if not s.is_terminal)
        await self.store.set_status(
            self.batch_id, final, allowed, **{str(k): v for k, v in extra.items()}
        )
        await self._retire()
        log.info(
            "batch %s %s: %d succeeded, %d in the error file",
            self.batch_id,
            final.value,
            out.lines,
            err.lines,
        )
        return True

    async def _retire(self) -> None:
        """A finished batch leaves the active set, its bookkeeping goes, its record expires.
        Runs after the final status is stored, so a crash before it only repeats it."""
        async with pipeline(self.redis, atomic=True) as pipe:
            pipe.srem(self.keys.active_batches(), self.batch_id)
            pipe.expire(self.keys.batch(self.batch_id), self.settings.batch_retention_s)
            pipe.delete(
                self.keys.batch_lines(self.batch_id),
                self.keys.batch_outputs(self.batch_id),
                self.keys.batch_errors(self.batch_id),
                self.keys.batch_ended(self.batch_id),
            )
            await pipe.execute()

    async def _save(
        self, file_id: str, kind: str, key: str, count: Callable[[str], bool] | None = None
    ) -> WrittenFile:
        return await write_lines_file(
            self.redis,
            self.files,
            key,
            file_id=file_id,
            owner=self.owner,
            filename=f"{self.batch_id}_{kind}.jsonl",
            created_at=now_s(),
            ttl_s=self.settings.batch_retention_s,
            last_line=len(self.input.raw_lines) or None,
            count=count,
        )


def _count_failed(line: str) -> bool:
    """An error line of a request that ran and failed (not one the batch never ran)."""
    return _error_code(line) not in NOT_RUN_CODES


def _error_code(line: str) -> str | None:
    try:
        return json.loads(line)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
