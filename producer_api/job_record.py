"""A stored job: read its record (get_job), or cancel it (cancel_job: the status transition,
the workers told on the control channel, its queue entry deleted).
"""

from __future__ import annotations

from pydantic import ValidationError
from redis.asyncio import Redis

from producer_api.queue_errors import JobNotFoundError, QueueError
from redis_io.scripts import run_script
from schemas import (
    TRANSITION_SCRIPT,
    ControlMessage,
    ErrorBody,
    ErrorCode,
    Job,
    JobStatus,
    RedisKeys,
    is_valid_job_id,
    transition_applied,
    transition_call,
    utc_now,
)
from schemas.jobs import JobField
from schemas.redis_scripts import job_channel_script


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
