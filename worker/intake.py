"""Reading jobs-stream entries and deciding what each one is: a job to run, or one to skip,
expire or dead-letter. Reads only; the worker queues the resulting writes in its outbox."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from redis_io.clients import raise_for_cluster_outage
from schemas import (
    TERMINAL_STATUSES,
    ErrorBody,
    ErrorCode,
    Job,
    JobField,
    JobStatus,
    RedisKeys,
    RunState,
    TokenChunk,
    error_from_validation,
    is_valid_job_id,
)
from schemas.chunks import REPLAY_FIELD
from schemas.jobs import as_text
from schemas.keys import JOB_ENTRY_FIELD
from worker.crashes import CrashPolicy, FirstStep, settle_cut_off_start
from worker.held import HeldJob
from worker.logs import log_event

logger = logging.getLogger(__name__)


@dataclass
class Entry:
    """One jobs-stream entry as delivered; `fields` is None when the entry was deleted.
    `stream`: the stream it came from ("" for the worker's jobs stream). `unreadable`: why the
    entry cannot be read (its `fields` are then a lossy copy, for the dead letter). `reclaimed`:
    delivered before, to a worker that did not finish it (taken over, or re-read after a
    restart)."""

    entry_id: str
    fields: dict[str, str] | None
    stream: str = ""
    unreadable: str | None = None
    reclaimed: bool = False


@dataclass(frozen=True)
class UnreadableJob:
    """A job hash that could not be read (not UTF-8 text, or the key is no hash)."""

    reason: str


@dataclass
class Admit:
    held: HeldJob


@dataclass
class Skip:
    """Nothing to run (job gone, already ended, superseded): XACK + XDEL only."""

    entry_id: str
    job_id: str | None
    reason: str
    stream: str = ""


@dataclass
class Expire:
    entry_id: str
    job_id: str
    stream: str = ""


@dataclass
class Reject:
    """Cannot run: dead letter with `error.code` as the reason; job marked failed if stored."""

    entry_id: str
    job_id: str | None
    error: ErrorBody
    entry_fields: dict[str, str]
    attempts: int = 0
    stream: str = ""


Verdict = Admit | Skip | Expire | Reject


StoredJob = dict[str, str] | UnreadableJob | None
"""What an entry's job key holds: its hash, why it cannot be read, or None (nothing stored)."""


def classify(entry: Entry, stored: StoredJob, now: datetime) -> Verdict:
    """Decide one entry given its job hash (`stored`, None when the entry names no job). Whether
    earlier starts leave the job any is decided once its chunks are read (`settle`)."""
    try:
        verdict = _classify(entry, stored, now)
    except Exception as exc:  # one entry nobody foresaw must not stop the entries read with it
        logger.exception("could not classify entry %s", entry.entry_id)
        error = ErrorBody.of(ErrorCode.UNPARSEABLE_JOB, f"the entry could not be parsed: {exc}")
        verdict = Reject(entry.entry_id, None, error, entry.fields or {})
    if isinstance(verdict, Admit):
        verdict.held.queue_stream = entry.stream
    else:
        verdict.stream = entry.stream
    return verdict


def _classify(entry: Entry, stored: StoredJob, now: datetime) -> Verdict:
    if entry.fields is None:
        return Skip(entry.entry_id, None, "entry deleted")
    job_id = entry.fields.get(JOB_ENTRY_FIELD)
    if not job_id or not is_valid_job_id(job_id):
        job_id = None
    if entry.unreadable is not None:
        error = ErrorBody.of(ErrorCode.UNPARSEABLE_JOB, entry.unreadable)
        return Reject(entry.entry_id, job_id, error, entry.fields)
    if job_id is None:
        error = ErrorBody.of(
            ErrorCode.UNPARSEABLE_JOB, f"stream entry has no valid '{JOB_ENTRY_FIELD}' field"
        )
        return Reject(entry.entry_id, None, error, entry.fields)
    if isinstance(stored, UnreadableJob):
        error = ErrorBody.of(ErrorCode.UNPARSEABLE_JOB, stored.reason)
        return Reject(entry.entry_id, job_id, error, entry.fields)
    if not stored:
        return Skip(entry.entry_id, job_id, "job hash missing")
    status = stored.get(JobField.STATUS)
    if status in TERMINAL_STATUSES:
        return Skip(entry.entry_id, job_id, f"job already {status}")
    try:
        job = Job.from_redis_hash(stored)
    except ValidationError as exc:
        attempts = _int(stored.get(JobField.ATTEMPTS))
        if any(error["loc"] and error["loc"][0] == JobField.REQUEST for error in exc.errors()):
            error = error_from_validation(exc, ErrorCode.INVALID_REQUEST)
        else:
            error = error_from_validation(exc, ErrorCode.UNPARSEABLE_JOB)
        return Reject(entry.entry_id, job_id, error, entry.fields, attempts)
    if job.entry_id is not None and job.entry_id != entry.entry_id:
        return Skip(entry.entry_id, job_id, f"superseded by entry {job.entry_id}")
    if job.request.is_past_deadline(now):
        return Expire(entry.entry_id, job_id)
    return Admit(HeldJob.fresh(job, entry.entry_id))


def settle(
    entry: Entry, verdict: Verdict, policy: CrashPolicy, first_step: FirstStep = FirstStep.OUTSIDE
) -> Verdict:
    """An admitted job, or its dead letter when its earlier starts leave it no more.
    `first_step`: how the job stood in its last worker's first-step marker."""
    if not isinstance(verdict, Admit):
        return verdict
    held = verdict.held
    error = settle_cut_off_start(held, entry.reclaimed, first_step, policy)
    if error is None:
        return verdict
    fields = entry.fields or {}
    return Reject(held.entry_id, held.job_id, error, fields, held.job.attempts, entry.stream)


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


class StreamReader:
    """The reads of one worker on its model's jobs stream (consumer group `keys.group`).

    `redis` must not decode replies (`decode_responses=False`): redis-py decodes a reply whole,
    so one entry or job hash that is not UTF-8 would fail every read that returns it, and the
    entries read with it. Here each entry and hash is decoded on its own, and one that cannot be
    becomes a dead letter like any other unreadable entry."""

    def __init__(self, redis: Redis, keys: RedisKeys, stream: str, consumer: str) -> None:
        self.redis = redis
        self.keys = keys
        self.stream = stream
        self.consumer = consumer
        self._claim_cursor = "0-0"

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, self.keys.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read_new(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to `count` never-delivered entries; waits up to `block_ms` only when given."""
        reply = await self.redis.xreadgroup(
            self.keys.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms
        )
        return _entries(reply)

    async def read_own_pending(self, limit: int = 1000) -> list[Entry]:
        """Entries this consumer name was given earlier and never acked (a restart with the same
        name, or reads whose follow-up was cut off by a lost connection)."""
        out: list[Entry] = []
        start = "0"
        while len(out) < limit:
            reply = await self.redis.xreadgroup(
                self.keys.group, self.consumer, {self.stream: start}, count=100
            )
            batch = _entries(reply)
            if not batch:
                break
            for entry in batch:
                entry.reclaimed = True
            out.extend(batch)
            start = batch[-1].entry_id
        return out

    async def autoclaim(self, min_idle_ms: int, count: int) -> list[Entry]:
        """Take over up to `count` entries idle for `min_idle_ms` (their worker stopped
        renewing: it died or lost Redis). Walks the pending list across calls."""
        reply = await self.redis.xautoclaim(
            self.stream,
            self.keys.group,
            self.consumer,
            min_idle_ms,
            start_id=self._claim_cursor,
            count=count,
        )
        next_cursor, claimed = reply[0], reply[1]
        self._claim_cursor = as_text(next_cursor) or "0-0"
        entries = [
            _entry(entry_id, fields, self.stream) for entry_id, fields in claimed if entry_id
        ]
        for entry in entries:
            entry.reclaimed = True
        return entries

    async def claim_from(self, consumer: str, count: int, min_idle_ms: int) -> list[Entry]:
        """Take over up to `count` pending entries of `consumer` (a worker known dead) idle for
        `min_idle_ms`: a claim resets an entry's idle time, so of two workers claiming the same
        dead worker's entries at once each entry goes to one."""
        pending = await self.redis.xpending_range(
            self.stream, self.keys.group, min="-", max="+", count=count, consumername=consumer
        )
        ids = [item["message_id"] for item in pending]
        if not ids:
            return []
        claimed = await self.redis.xclaim(
            self.stream, self.keys.group, self.consumer, min_idle_ms, ids
        )
        entries = [
            _entry(entry_id, fields, self.stream) for entry_id, fields in claimed if entry_id
        ]
        for entry in entries:
            entry.reclaimed = True
        return entries

    async def load(self, entries: list[Entry], policy: CrashPolicy, now: datetime) -> list[Verdict]:
        """Classify entries (one pipeline of HGETALLs) and, for jobs that earlier attempts
        already started, read their published chunks to resume from and whether their last
        worker died in their first step (one more pipeline); then settle their cut-off starts
        (worker.crashes)."""
        if not entries:
            return []
        # (stream, entry id) -> the job it names: a model's partitions may repeat an entry id
        job_ids = {
            (e.stream, e.entry_id): e.fields.get(JOB_ENTRY_FIELD, "") for e in entries if e.fields
        }
        named = {entry: job for entry, job in job_ids.items() if is_valid_job_id(job)}
        stored: dict[tuple[str, str], StoredJob] = {}
        if named:
            async with self.redis.pipeline(transaction=False) as pipe:
                for job_id in named.values():
                    pipe.hgetall(self.keys.job(job_id))
                replies = await pipe.execute(raise_on_error=False)
            await raise_for_cluster_outage(self.redis, replies)
            for entry, reply in zip(named, replies, strict=True):
                stored[entry] = _job_hash(reply)
        verdicts = [classify(e, stored.get((e.stream, e.entry_id)), now) for e in entries]
        resuming = [
            v.held
            for v in verdicts
            if isinstance(v, Admit)
            and (
                v.held.job.status is JobStatus.RUNNING
                or v.held.job.attempts
                or v.held.job.run_state is not None
            )
        ]
        first_steps: dict[str, FirstStep] = {}
        if resuming:
            suspects = [h for h in resuming if h.job.run_state is RunState.STARTED and h.job.worker]
            async with self.redis.pipeline(transaction=False) as pipe:
                for held in resuming:
                    pipe.xrange(self.keys.out_stream(held.job_id), "-", "+")
                for held in suspects:
                    marker = self.keys.first_step(held.job.worker or "")
                    pipe.sismember(marker, held.job_id)
                    pipe.scard(marker)
                replies = await pipe.execute(raise_on_error=False)
            await raise_for_cluster_outage(self.redis, replies)
            replays, marks = replies[: len(resuming)], replies[len(resuming) :]
            marks = list(zip(marks[0::2], marks[1::2], strict=True))
            for held, replay in zip(resuming, replays, strict=True):
                held.resume_from(_chunks(held.job_id, replay))
            for held, (member, size) in zip(suspects, marks, strict=True):
                if isinstance(member, ResponseError):  # not a set: no evidence
                    continue
                for reply in (member, size):
                    if isinstance(reply, Exception):
                        raise reply
                if member:
                    alone = size == 1
                    first_steps[held.job_id] = FirstStep.ALONE if alone else FirstStep.SHARED
        return [
            settle(
                e,
                v,
                policy,
                first_steps.get(v.held.job_id, FirstStep.OUTSIDE)
                if isinstance(v, Admit)
                else FirstStep.OUTSIDE,
            )
            for e, v in zip(entries, verdicts, strict=True)
        ]


# XREADGROUP's reply, undecoded: per stream, its entries as (id, fields); fields None for a
# deleted entry.
RawFields = dict[bytes, bytes]
StreamReply = list[tuple[bytes, list[tuple[bytes | None, RawFields | None]]]]


def _entries(reply: StreamReply | None) -> list[Entry]:
    if not reply:
        return []
    out = []
    for stream, items in reply:
        for entry_id, fields in items:
            if entry_id is not None:
                out.append(_entry(entry_id, fields, as_text(stream)))
    return out


# READ_NEW_JOBS_SCRIPT's reply, undecoded: per stream, its entries as [id, [field, value, ...]]
# (each a two-item list on the wire; None for the fields of a deleted entry).
ScriptReply = list[list[tuple[bytes, list[bytes] | None]]]


def script_entries(reply: ScriptReply, streams: tuple[str, ...]) -> list[Entry]:
    """The entries of a script's per-stream reply (`streams`: the stream of each part)."""
    out = []
    for stream, items in zip(streams, reply, strict=True):
        for entry_id, flat in items:
            fields = dict(zip(flat[::2], flat[1::2], strict=True)) if flat else None
            out.append(_entry(entry_id, fields, stream))
    return out


def _entry(entry_id: bytes | str, fields: RawFields | None, stream: str) -> Entry:
    """Decode one entry on its own; text that is not UTF-8 makes it unreadable."""
    if not fields:
        return Entry(as_text(entry_id), None, stream)
    try:
        return Entry(as_text(entry_id), _decoded(fields), stream)
    except UnicodeDecodeError:
        lossy = {
            key.decode(errors="backslashreplace"): value.decode(errors="backslashreplace")
            for key, value in fields.items()
        }
        return Entry(as_text(entry_id), lossy, stream, "stream entry is not UTF-8 text")


def _job_hash(reply: RawFields | Exception) -> StoredJob:
    if isinstance(reply, ResponseError):  # WRONGTYPE: the job key holds no hash
        return UnreadableJob(f"the job key cannot be read as a hash: {reply}")
    if isinstance(reply, Exception):  # the connection went: the whole read is retried
        raise reply
    try:
        return _decoded(reply)
    except UnicodeDecodeError:
        return UnreadableJob("the job hash is not UTF-8 text")


def _decoded(fields: RawFields) -> dict[str, str]:
    return {key.decode(): value.decode() for key, value in fields.items()}


def _chunks(job_id: str, replay: list[tuple[bytes, RawFields]] | Exception) -> list[TokenChunk]:
    if isinstance(replay, ResponseError):  # the replay key holds no stream: nothing to resume
        log_event(logger, logging.WARNING, "unreadable_replay", job=job_id, error=replay)
        return []
    if isinstance(replay, Exception):
        raise replay
    chunks = []
    field = REPLAY_FIELD.encode()
    for entry_id, fields in replay:
        try:
            chunks.append(TokenChunk.from_json(fields[field].decode()))
        except (KeyError, ValueError):  # UnicodeDecodeError is a ValueError
            log_event(
                logger, logging.WARNING, "unreadable_chunk", job=job_id, entry=as_text(entry_id)
            )
    return chunks
