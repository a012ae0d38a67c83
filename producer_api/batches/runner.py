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
later runs find the valid ones without parsing the file again; it keeps the first lines it parsed
(as many as may be in flight) for fan-out, which parses only the lines after those."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis

from producer_api import queue
from producer_api.batches.collect import COLLECT_CHUNK, Collector
from producer_api.batches.input_lines import InputLines
from producer_api.batches.lease_holder import holder_token
from producer_api.batches.lines import (
    EMBEDDINGS,
    line_not_run,
    line_of_error,
)
from producer_api.batches.output_files import WrittenFile, write_lines_file
from producer_api.batches.store import now_s
from redis_io.clients import pipeline
from redis_io.scripts import run_script
from schemas import (
    BatchField,
    BatchStatus,
)
from schemas.batches import BATCH_ID_PREFIX
from schemas.redis_scripts import LEASE_RELEASE_SCRIPT, LEASE_RENEW_SCRIPT

log = logging.getLogger(__name__)

CANCELLED_CODE = "batch_cancelled"
EXPIRED_CODE = "batch_expired"
NOT_RUN_CODES = (CANCELLED_CODE, EXPIRED_CODE)
_ERROR_WRITE_CHUNK = 1000  # error lines written per round trip while validating or stopping
_FAILURE_DETAILS = 10  # invalid lines named in a failed batch's errors


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


class BatchRunner(Collector):
    """Advances one batch a controller run at a time (see the module's docstring)."""

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
        for line in self.input.scan(keep=self.settings.batch_max_in_flight):
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
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hsetnx(key, BatchField.GROUP_LINES, str(size))
            pipe.hget(key, BatchField.GROUP_LINES)
            _, stored = await pipe.execute()
        self.group_lines = int(stored or 1)

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
        for start in range(0, len(numbers), COLLECT_CHUNK):
            part = numbers[start : start + COLLECT_CHUNK]
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hmget(self.keys.batch_outputs(self.batch_id), part)
                pipe.hmget(self.keys.batch_errors(self.batch_id), part)
                out, err = await pipe.execute()
            written.update(n for n, o, e in zip(part, out, err, strict=True) if o or e)
        return written

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
