"""The producer side of the queue, straight on Redis: enqueue, get, wait, stream, cancel.

Both the HTTP API and the Python client (`producer_api.client.redis_client`) call these
functions; they follow the contract in `schemas.keys`, `schemas.chunks` and `schemas.events`.
Every function takes a `redis.asyncio.Redis` (str or bytes responses both work) and the
`RedisKeys` naming the deployment.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError as RedisReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer_api.backlog import queue_length as queue_length  # callers read it here too
from producer_api.cluster_queue import cluster_enqueue
from redis_io.clients import CLUSTER_AWAY, pipeline
from redis_io.pubsub import job_pubsub
from redis_io.replica_wait import replicated, wait_command
from redis_io.scripts import run_script
from schemas import (
    IDEMPOTENCY_TTL_S,
    TRANSITION_SCRIPT,
    ControlMessage,
    ErrorBody,
    ErrorCode,
    Job,
    JobRequest,
    JobStatus,
    RedisKeys,
    StatusEvent,
    TokenChunk,
    is_valid_job_id,
    parse_channel_message,
    replay_start_after,
    transition_applied,
    transition_call,
    utc_now,
)
from schemas.chunks import REPLAY_FIELD, chunk_stream_id
from schemas.jobs import JobField, as_text
from schemas.redis_connection import ReplicaWait
from schemas.redis_scripts import ENQUEUE_SCRIPT, EnqueueOutcome, job_channel_script

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL_S = 1.0
SUBSCRIBE_TIMEOUT_S = 5.0
# What Redis being away (down, restarting, unreachable, or a master demoted by a failover that
# now answers READONLY) raises from these functions; OSError covers the socket errors that
# reach us unwrapped.
REDIS_UNAVAILABLE: tuple[type[Exception], ...] = (
    *CLUSTER_AWAY,
    RedisConnectionError,
    RedisTimeoutError,
    RedisReadOnlyError,
    OSError,
)


class QueueError(Exception):
    """A refusal or failure with the ErrorBody the API sends back."""

    def __init__(self, error: ErrorBody) -> None:
        super().__init__(error.message)
        self.error = error

    @property
    def code(self) -> ErrorCode:
        return self.error.code


class QueueFullError(QueueError):
    def __init__(self, model: str, backlog: int, limit: int) -> None:
        super().__init__(
            ErrorBody.of(
                ErrorCode.QUEUE_FULL,
                f"model: the queue of {model!r} holds {backlog} jobs (limit {limit}); retry later",
                "model",
            )
        )
        self.backlog = backlog
        self.limit = limit


class JobNotFoundError(QueueError):
    def __init__(self, job_id: str) -> None:
        super().__init__(ErrorBody.of(ErrorCode.NOT_FOUND, f"no job {job_id!r}"))
        self.job_id = job_id


async def enqueue(
    redis: Redis,
    keys: RedisKeys,
    request: JobRequest,
    *,
    owner: str | None = None,
    max_queue_len: int | None = None,
    replicas: ReplicaWait | None = None,
) -> Job:
    """Store a new queued job and add it to its model's stream; returns it.

    With `request.idempotency_key`, a second call (same owner and key, within IDEMPOTENCY_TTL_S,
    while the first job is still stored) returns the first job instead. With `replicas`, the
    job is answered only once that many replicas have it (or the WAIT timed out). Raises QueueFullError
    when the model's backlog (queued + running entries) is at `max_queue_len`, and QueueError
    (invalid_request) when the deadline has already passed."""
    if max_queue_len is not None and max_queue_len < 1:
        raise ValueError("max_queue_len must be at least 1 (None: no limit)")
    check_deadline(request)
    job = Job.new(request, owner=owner)
    if keys.cluster:
        outcome, value = await cluster_enqueue(
            redis,
            keys,
            job,
            idempotency_key=request.idempotency_key,
            owner=owner,
            max_queue_len=max_queue_len,
        )
    else:
        outcome, value = await _enqueue_on_one_node(
            redis, keys, job, owner=owner, max_queue_len=max_queue_len, replicas=replicas
        )
    return await enqueued(redis, keys, job, outcome, value, max_queue_len)


def check_deadline(request: JobRequest) -> None:
    """QueueError (invalid_request) when the request's deadline has already passed."""
    if request.is_past_deadline():
        raise QueueError(
            ErrorBody.of(ErrorCode.INVALID_REQUEST, "deadline: is already in the past", "deadline")
        )


async def enqueued(
    redis: Redis,
    keys: RedisKeys,
    job: Job,
    outcome: str | bytes,
    value: str | bytes,
    max_queue_len: int | None,
) -> Job:
    """The job ENQUEUE_SCRIPT's reply for `job` stands for: `job` itself, the job an earlier
    call with its idempotency key created, or QueueFullError."""
    outcome, value = EnqueueOutcome(as_text(outcome)), as_text(value)
    if outcome is EnqueueOutcome.CREATED:
        return job.model_copy(update={"entry_id": value})
    if outcome is EnqueueOutcome.EXISTING:
        return await get_job(redis, keys, value)
    raise QueueFullError(job.request.model, int(value), max_queue_len or 0)


def enqueue_call(
    keys: RedisKeys, job: Job, *, owner: str | None, max_queue_len: int | None
) -> tuple[list[str], list[str | int]]:
    """ENQUEUE_SCRIPT's keys and arguments for `job` on a single node or Sentinel master. With
    several partitions each holds its share of `max_queue_len`."""
    request = job.request
    # Bulk work waits on its own stream, so its backlog neither delays nor 429s interactive jobs.
    script_keys = [keys.job(job.id), keys.queue_stream(request.model, request.priority, job.id)]
    if request.idempotency_key is not None:
        script_keys.append(keys.idempotency(request.idempotency_key, owner))
    limit = -(-max_queue_len // keys.partitions) if max_queue_len else 0
    args: list[str | int] = [
        job.id,
        limit,
        IDEMPOTENCY_TTL_S,
        keys.job_key_prefix(),
        keys.arrivals_channel(request.model),
    ]
    for name, value in job.to_redis_hash().items():
        args += [name, value]
    return script_keys, args


async def _enqueue_on_one_node(
    redis: Redis,
    keys: RedisKeys,
    job: Job,
    *,
    owner: str | None,
    max_queue_len: int | None,
    replicas: ReplicaWait | None,
) -> tuple[str | bytes, str | bytes]:
    """ENQUEUE_SCRIPT's reply for `job` (one atomic step on a single node or Sentinel master).
    With several partitions each holds its share of `max_queue_len`."""
    script_keys, args = enqueue_call(keys, job, owner=owner, max_queue_len=max_queue_len)
    if replicas is None:
        outcome, value = await run_script(redis, ENQUEUE_SCRIPT, script_keys, args)
        return outcome, value
    # One pipeline, so the WAIT runs on the connection that wrote the job.
    async with redis.pipeline(transaction=False) as pipe:
        script = redis.register_script(ENQUEUE_SCRIPT)  # loaded before the pipeline runs
        await script(keys=script_keys, args=args, client=pipe)
        pipe.execute_command(*wait_command(replicas))
        (outcome, value), reached = await pipe.execute()
    replicated(reached, replicas, f"job {job.id}")
    return outcome, value


async def get_job(redis: Redis, keys: RedisKeys, job_id: str) -> Job:
    """The stored job; JobNotFoundError when it does not exist (or has expired)."""
    if not is_valid_job_id(job_id):
        raise JobNotFoundError(job_id)
    stored = await redis.hgetall(keys.job(job_id))
    if not stored:
        raise JobNotFoundError(job_id)
    try:
        return Job.from_redis_hash(stored)
    except ValidationError as exc:
        raise QueueError(
            ErrorBody.of(ErrorCode.UNPARSEABLE_JOB, f"job {job_id!r} is corrupt: {exc}")
        ) from exc


async def cancel_job(
    redis: Redis, keys: RedisKeys, job_id: str, *, reason: str = "cancelled by the client"
) -> Job:
    """Cancel a queued or running job and tell the workers; a finished job is left as it is.
    Returns the job as stored afterwards."""
    job = await get_job(redis, keys, job_id)
    if job.status.is_terminal:
        return job
    fields = {
        JobField.FINISHED_AT: utc_now(),
        JobField.ERROR: ErrorBody.of(ErrorCode.CANCELLED, reason),
    }
    script_keys, args = transition_call(keys, job_id, JobStatus.CANCELLED, fields)
    script = job_channel_script(TRANSITION_SCRIPT, keys)
    reply = await run_script(redis, script, script_keys, args)
    applied, previous = transition_applied(reply)
    if applied:
        async with redis.pipeline(transaction=False) as pipe:
            control = ControlMessage(op="cancel", job_id=job_id).to_json()
            pipe.execute_command("PUBLISH", keys.control_channel(), control)
            if previous in (JobStatus.QUEUED, JobStatus.RUNNING) and job.entry_id:
                # Shrinks the backlog (XLEN, which batch fan-out is throttled by) at once. A
                # worker that read the entry finds the job cancelled when it tries to start it,
                # or aborts it on the broadcast; its XACK of the entry still clears its PEL.
                stream = keys.queue_stream(job.model, job.request.priority, job_id)
                pipe.xdel(stream, job.entry_id)
            await pipe.execute()
    return await get_job(redis, keys, job_id)


@asynccontextmanager
async def _subscribed(redis: Redis, channel: str) -> AsyncIterator[PubSub]:
    """A pubsub on `channel` whose subscription the server has confirmed, so no message
    published after this point is missed."""
    pubsub = await job_pubsub(redis, channel)
    try:
        await pubsub.subscribe(channel)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + SUBSCRIBE_TIMEOUT_S
        while True:
            message = await pubsub.get_message(timeout=max(give_up - loop.time(), 0.0))
            if message is not None and message["type"] in ("subscribe", b"subscribe"):
                break
            if loop.time() >= give_up:
                raise QueueError(
                    ErrorBody.of(ErrorCode.UNAVAILABLE, f"could not subscribe to {channel}")
                )
        yield pubsub
    finally:
        await pubsub.aclose()


def _ends_job(message: TokenChunk | StatusEvent) -> bool:
    if isinstance(message, TokenChunk):
        return message.final
    return message.status.is_terminal


def _parse_live(data: str | bytes) -> TokenChunk | StatusEvent | None:
    try:
        return parse_channel_message(data)
    except ValueError:
        log.warning("ignoring an unreadable message on a job channel: %.200r", data)
        return None


async def wait_job(
    redis: Redis,
    keys: RedisKeys,
    job_id: str,
    *,
    timeout: float | None = None,
    poll_interval: float = DEFAULT_POLL_INTERVAL_S,
) -> Job:
    """Wait until the job reaches a terminal status and return it. After `timeout` seconds the
    job is returned as it is then (check `job.status.is_terminal`). Wakes on the job channel's
    final chunk or status event, and re-reads the hash every `poll_interval` in case a pub/sub
    message was lost."""
    if not is_valid_job_id(job_id):
        raise JobNotFoundError(job_id)
    loop = asyncio.get_running_loop()
    give_up = None if timeout is None else loop.time() + timeout
    async with _subscribed(redis, keys.channel(job_id)) as pubsub:
        job = await get_job(redis, keys, job_id)
        next_poll = loop.time() + poll_interval
        while not job.status.is_terminal:
            now = loop.time()
            if give_up is not None and now >= give_up:
                return job
            wake_at = next_poll if give_up is None else min(next_poll, give_up)
            message = await pubsub.get_message(
                ignore_subscribe_messages=True, timeout=max(wake_at - now, 0.0)
            )
            parsed = None if message is None else _parse_live(message["data"])
            if (parsed is not None and _ends_job(parsed)) or loop.time() >= next_poll:
                job = await get_job(redis, keys, job_id)
                next_poll = loop.time() + poll_interval
        return job


class _ChunkCursor:
    """Hands out each chunk index once and in order, however often chunks arrive."""

    def __init__(self, last_index: int) -> None:
        self.last_index = last_index
        self.finished = False

    def fresh(self, chunks: list[TokenChunk]) -> list[TokenChunk]:
        out = []
        for chunk in chunks:
            if self.finished or chunk.index <= self.last_index:
                continue
            if chunk.index > self.last_index + 1:
                log.warning(
                    "job %s: chunks %d..%d are gone from the replay stream",
                    chunk.job_id,
                    self.last_index + 1,
                    chunk.index - 1,
                )
            out.append(chunk)
            self.last_index = chunk.index
            self.finished = chunk.final
        return out


async def _replay(
    redis: Redis, keys: RedisKeys, job_id: str, after: int, upto: int | None = None
) -> list[TokenChunk]:
    end = "+" if upto is None else chunk_stream_id(upto)
    entries = await redis.xrange(keys.out_stream(job_id), min=replay_start_after(after), max=end)
    return [_chunk_of_entry(fields) for _, fields in entries]


async def _status_and_replay(
    redis: Redis, keys: RedisKeys, job_id: str, after: int
) -> tuple[JobStatus | None, list[TokenChunk]]:
    """One consistent snapshot (MULTI; on a cluster, both keys on the job's node, read in this
    order: a job's chunks are all written before its final status) of the job's status and its
    chunks after `after`."""
    async with pipeline(redis, atomic=True) as pipe:
        pipe.hget(keys.job(job_id), JobField.STATUS)
        pipe.xrange(keys.out_stream(job_id), min=replay_start_after(after), max="+")
        status, entries = await pipe.execute()
    chunks = [_chunk_of_entry(fields) for _, fields in entries]
    return (None if status is None else JobStatus(as_text(status))), chunks


def _chunk_of_entry(fields: Mapping[str | bytes, str | bytes]) -> TokenChunk:
    raw = fields.get(REPLAY_FIELD)
    if raw is None:
        raw = fields[REPLAY_FIELD.encode()]
    return TokenChunk.from_json(raw)


async def stream_chunks(
    redis: Redis,
    keys: RedisKeys,
    job_id: str,
    *,
    last_index: int = -1,
    poll_interval: float = DEFAULT_POLL_INTERVAL_S,
) -> AsyncIterator[TokenChunk]:
    """Every chunk of the job after `last_index`, each exactly once and in index order, live.

    Subscribes to the job channel first, then replays the replay stream, then follows live
    messages; a gap in the live numbering is filled from the replay stream. Ends after the final
    chunk, or once the job is terminal (status event, or a poll every `poll_interval`) and the
    replay stream is drained. Raises JobNotFoundError for an unknown job."""
    if not is_valid_job_id(job_id):
        raise JobNotFoundError(job_id)
    cursor = _ChunkCursor(last_index)
    loop = asyncio.get_running_loop()
    async with _subscribed(redis, keys.channel(job_id)) as pubsub:
        status, replayed = await _status_and_replay(redis, keys, job_id, cursor.last_index)
        if status is None:
            raise JobNotFoundError(job_id)
        for chunk in cursor.fresh(replayed):
            yield chunk
        ended = status.is_terminal
        next_poll = loop.time() + poll_interval
        while not (ended or cursor.finished):
            message = await pubsub.get_message(
                ignore_subscribe_messages=True, timeout=max(next_poll - loop.time(), 0.0)
            )
            parsed = None if message is None else _parse_live(message["data"])
            if isinstance(parsed, TokenChunk) and parsed.index > cursor.last_index:
                batch = [parsed]
                if parsed.index > cursor.last_index + 1:
                    # A live message was lost: the replay stream has everything up to this one.
                    batch = await _replay(redis, keys, job_id, cursor.last_index, parsed.index)
                    batch.append(parsed)
                for chunk in cursor.fresh(batch):
                    yield chunk
            elif (parsed is not None and _ends_job(parsed)) or loop.time() >= next_poll:
                status, replayed = await _status_and_replay(redis, keys, job_id, cursor.last_index)
                for chunk in cursor.fresh(replayed):
                    yield chunk
                ended = status is None or status.is_terminal
                next_poll = loop.time() + poll_interval
