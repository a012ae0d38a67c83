"""Enqueue a job: validate it, store it queued and add it to its model's stream, in one atomic
script on a single node or Sentinel master (or the steps of producer_api.cluster_queue on a
cluster), with the idempotency key, the backlog limit and, if asked, a wait for replicas.
"""

from __future__ import annotations

from redis.asyncio import Redis

from producer_api.cluster_queue import cluster_enqueue
from producer_api.job_record import get_job
from producer_api.queue_errors import QueueError, QueueFullError
from redis_io.replica_wait import replicated, wait_command
from redis_io.scripts import run_script
from schemas import IDEMPOTENCY_TTL_S, ErrorBody, ErrorCode, Job, JobRequest, RedisKeys
from schemas.jobs import as_text
from schemas.redis_connection import ReplicaWait
from schemas.redis_scripts import ENQUEUE_SCRIPT, EnqueueOutcome


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
