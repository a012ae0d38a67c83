"""Collection: the lines of the jobs that ended into the output or error file, each line
from its own result (a group's job names its lines: each is written from its own input's
vector). A group whose job failed runs its lines again one job each, so one bad input fails
its line alone. Writing a line twice leaves one line (the files are hashes by line number)."""

from __future__ import annotations

import logging

from producer_api.batches.fan_out import FanOut
from producer_api.batches.groups import LineGroup, carried_lines, group_output_lines
from producer_api.batches.lines import line_not_run, line_of_result
from redis_io.clients import pipeline
from schemas import TERMINAL_STATUSES, ErrorCode, Job, JobField, JobStatus

log = logging.getLogger(__name__)

COLLECT_CHUNK = 500  # jobs read per round trip
# a group's job ended so (or succeeded without a vector per line): its lines run again alone
_RETRIED_GROUP_STATUSES = frozenset({JobStatus.FAILED, JobStatus.SUCCEEDED})


class Collector(FanOut):
    """Collection of a controller run (see the module's docstring); fan-out below it."""

    async def _collect_announced(self) -> None:
        """Write the lines of the jobs whose workers announced their end since the last look."""
        key = self.keys.batch_ended(self.batch_id)
        while True:
            announced = await self.redis.lpop(key, COLLECT_CHUNK)
            if not announced:
                return
            jobs = [job for job in dict.fromkeys(announced) if job in self.lines_of]
            if jobs:  # their workers said they ended: the records at once, no status read first
                await self._write_ended(_ended(jobs, await self._records(jobs)), retry_groups=True)
            if len(announced) < COLLECT_CHUNK:
                return

    async def _sweep(self, *, retry_groups: bool = True) -> None:
        """Every outstanding job's status: the ends no worker announced (a cancel, an expiry, a
        dead letter, a worker that died between a result and its announcement)."""
        await self._collect(list(self.lines_of), retry_groups=retry_groups)

    async def _collect(self, jobs: list[str], *, retry_groups: bool = True) -> None:
        """Write the lines of those of `jobs` that ended."""
        for start in range(0, len(jobs), COLLECT_CHUNK):
            part = jobs[start : start + COLLECT_CHUNK]
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
                await self._write_ended(_ended(ended, await self._records(ended)), retry_groups)

    async def _records(self, jobs: list[str]) -> list[dict[str, str]]:
        """The stored records of `jobs`, in one round trip ({} for a record gone)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in jobs:
                pipe.hgetall(self.keys.job(job_id))
            return await pipe.execute()

    async def _write_ended(self, records: dict[str, dict[str, str]], retry_groups: bool) -> None:
        """Each ended job's lines (job id -> its record) into the output or error file. The
        lines of a group whose job failed (or gave no vector per line) run again one job each,
        unless `retry_groups` is False (the batch is stopping): then each gets the group's
        error."""
        if not records:
            return
        ended = list(records)
        out: dict[int, str] = {}
        err: dict[int, str] = {}
        again: list[LineGroup] = []
        for job_id, data in records.items():
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
            mine = set(numbers)  # the lines this batch's record gives the job (all it carries)
            if texts is not None:
                out.update((n, text) for n, text in zip(carried, texts, strict=True) if n in mine)
            elif retry_groups and len(lines) > 1 and job.status in _RETRIED_GROUP_STATUSES:
                log.info("batch %s: group job %s %s; its %d lines run one job each",
                         self.batch_id, job_id, job.status.value, len(lines))  # fmt: skip
                again += [LineGroup.alone(line) for line in lines if line.number in mine]
            else:
                err.update(
                    (line.number, line_of_result(line, job)[1])
                    for line in lines
                    if line.number in mine
                )
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


def _ended(jobs: list[str], records: list[dict[str, str]]) -> dict[str, dict[str, str]]:
    """Those of `jobs` whose record is gone or ended, with their records."""
    return {
        job_id: data
        for job_id, data in zip(jobs, records, strict=True)
        if not data or data.get(JobField.STATUS) in TERMINAL_STATUSES
    }
