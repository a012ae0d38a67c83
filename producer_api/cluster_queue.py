"""Enqueue on Redis Cluster, where a job's hash (its own slot, by its id's hash tag) and its
model's partition stream (another slot) cannot be written by one script. The steps, each atomic
on one slot, in the order that keeps every guarantee a worker relies on:

1. idempotency key: SET NX (an existing key naming a stored job answers with that job; one
   naming a job not stored yet is an enqueue racing this one, whose job is waited for);
2. backlog: the model's partitions' XLEN summed, against the limit (a soft limit here: two
   enqueues racing at the limit may both pass);
3. the job hash, queued, with a provisional TTL (CLUSTER_JOB_CREATE_SCRIPT);
4. XADD to the job's partition stream;
5. the hash records the entry and loses the provisional TTL (CLUSTER_JOB_ENTRY_SCRIPT), and
   the model's arrivals channel hears of the entry.

A worker that reads the entry between 4 and 5 finds the hash (3 came first) and runs the job;
an enqueue cut off between 3 and 4 was never answered, and its hash expires. A node that
refuses a write before step 4 (out of memory, read-only) gets the job's hash and idempotency key
deleted before the error goes back, so a retry with the key enqueues again at once.

Steps 3-5 are one atomic script (CLUSTER_ENQUEUE_LOCAL_SCRIPT, one round trip) where the job's
partition stream is on the node that holds its hash, as it is on an evenly split cluster (see
schemas.cluster_slots); the node refuses it before writing anything where it is not, and the
steps run instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from producer_api.backlog import queue_length
from redis_io.scripts import run_script
from schemas import IDEMPOTENCY_TTL_S, Job, RedisKeys
from schemas.jobs import as_text
from schemas.keys import JOB_ENTRY_FIELD, RESULT_TTL_S
from schemas.redis_scripts import (
    CLUSTER_ENQUEUE_LOCAL_SCRIPT,
    CLUSTER_JOB_CREATE_SCRIPT,
    CLUSTER_JOB_ENTRY_SCRIPT,
    LEASE_RELEASE_SCRIPT,
    EnqueueOutcome,
)

# What a cluster node answers a script that touches a key another node serves.
NOT_LOCAL = "non local key"
# How long an enqueue that lost the SET NX on an idempotency key waits for the winner's job
# hash (written one round trip after its SET): past it, the key names a job that is gone.
RACING_JOB_WAIT_S = 1.0
RACING_JOB_POLL_S = 0.01


async def cluster_enqueue(
    redis: Redis,
    keys: RedisKeys,
    job: Job,
    *,
    idempotency_key: str | None,
    owner: str | None,
    max_queue_len: int | None,
) -> tuple[EnqueueOutcome, str]:
    """ENQUEUE_SCRIPT's outcome for `job` on a cluster: (created, entry id), (existing, job
    id) or (full, backlog)."""
    request = job.request
    idem = None
    if idempotency_key is not None:
        idem = keys.idempotency(idempotency_key, owner)
        if not await redis.set(idem, job.id, nx=True, ex=IDEMPOTENCY_TTL_S):
            existing = await _stored_job_named(redis, keys, idem)
            if existing is not None:
                return EnqueueOutcome.EXISTING, existing
            await redis.set(idem, job.id, ex=IDEMPOTENCY_TTL_S)  # it named a job that is gone
    stream = keys.queue_stream(request.model, request.priority, job.id)
    if max_queue_len:
        bulk = stream in keys.bulk_streams(request.model)
        backlog = await queue_length(redis, keys, request.model, bulk=bulk)
        if backlog >= max_queue_len:
            await _release_key(redis, idem, job)  # a retry with the key must not wait for it
            return EnqueueOutcome.FULL, str(backlog)
    return EnqueueOutcome.CREATED, await _queue_job(redis, keys, job, stream, idem)


async def _queue_job(redis: Redis, keys: RedisKeys, job: Job, stream: str, idem: str | None) -> str:
    """Store `job` and add its entry to `stream` (steps 3-5); its entry id. A node that refuses
    a write before the entry exists (out of memory, read-only) leaves nothing of the job: its
    provisional hash and the idempotency key naming it go, so a retry with the key enqueues
    anew instead of finding a job that was never queued."""
    fields = [item for pair in job.to_redis_hash().items() for item in pair]
    job_key = keys.job(job.id)
    arrivals = keys.arrivals_channel(job.request.model)
    try:
        try:
            local = [stream, job.id, arrivals, *fields]
            entry = await run_script(redis, CLUSTER_ENQUEUE_LOCAL_SCRIPT, [job_key], local)
            if entry:
                return as_text(entry)
        except ResponseError as exc:
            if NOT_LOCAL not in str(exc):
                raise
        await run_script(redis, CLUSTER_JOB_CREATE_SCRIPT, [job_key], [RESULT_TTL_S, *fields])
        entry = as_text(await redis.xadd(stream, {JOB_ENTRY_FIELD: job.id}))
    except ResponseError:
        # The node's refusal is what the caller must see, even if the clean-up is refused too.
        with contextlib.suppress(RedisError):
            await redis.delete(job_key)  # no entry names it: no worker can hold it
        with contextlib.suppress(RedisError):
            await _release_key(redis, idem, job)
        raise
    # The entry exists: the job runs whatever happens next, and the key names it.
    await run_script(redis, CLUSTER_JOB_ENTRY_SCRIPT, [job_key], [entry])
    await redis.execute_command("PUBLISH", arrivals, entry)
    return entry


async def _release_key(redis: Redis, idem: str | None, job: Job) -> None:
    """Delete the idempotency key `idem` while it names `job` (the compare-and-delete of a
    lease's release), so a retry with the key does not wait for a job that never was."""
    if idem is not None:
        await run_script(redis, LEASE_RELEASE_SCRIPT, [idem], [job.id])


async def _stored_job_named(redis: Redis, keys: RedisKeys, idem: str) -> str | None:
    """The id of the job the idempotency key names, once that job is stored; None when the key
    is gone or names a job that did not appear within RACING_JOB_WAIT_S."""
    give_up = time.monotonic() + RACING_JOB_WAIT_S
    while True:
        named = await redis.get(idem)
        if named is None:
            return None
        if await redis.exists(keys.job(as_text(named))):
            return as_text(named)
        if time.monotonic() >= give_up:
            return None
        await asyncio.sleep(RACING_JOB_POLL_S)
