"""Giving unfinished jobs back to the queue at shutdown, so another worker resumes them now
(instead of after the janitor's min-idle time)."""

from __future__ import annotations

from redis.asyncio import Redis

from redis_io.scripts import evalsha_command, load_command, run_script
from schemas import RedisKeys
from schemas.keys import JOB_ENTRY_FIELD
from schemas.redis_scripts import (
    CLUSTER_HANDBACK_JOB_SCRIPT,
    CLUSTER_JOB_ENTRY_SCRIPT,
    HANDBACK_SCRIPT,
)
from worker.held import HeldJob


async def hand_back(
    redis: Redis, keys: RedisKeys, model: str, jobs: list[HeldJob]
) -> dict[str, str | None]:
    """Re-queue `model`'s `jobs` in one round trip; returns job id -> new entry id (None: job
    was over). Their published chunks stay, so whoever takes them next continues the
    numbering."""
    if not jobs:
        return {}
    if keys.cluster:
        return {held.job_id: await _hand_back_on_cluster(redis, keys, model, held) for held in jobs}
    jobs_stream = keys.jobs_stream(model)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.execute_command(*load_command(HANDBACK_SCRIPT))
        for held in jobs:
            script_keys = [
                held.queue_stream or jobs_stream,  # a bulk job goes back to the bulk stream
                keys.job(held.job_id),
            ]
            args = [
                keys.group,
                held.entry_id,
                held.job_id,
                "1" if held.start_confirmed else "0",
                keys.arrivals_channel(model),
            ]
            pipe.execute_command(*evalsha_command(HANDBACK_SCRIPT, script_keys, args))
        replies = await pipe.execute()
    return {held.job_id: reply for held, reply in zip(jobs, replies[1:], strict=True)}


async def _hand_back_on_cluster(
    redis: Redis, keys: RedisKeys, model: str, held: HeldJob
) -> str | None:
    """HANDBACK_SCRIPT's steps, each on one slot: the job forgets its entry (unless it is over),
    a new entry goes on the same stream, the job records it, and the old entry is retired
    last, so a worker that dies half-way leaves the job pending, never lost."""
    stream = held.queue_stream or keys.jobs_stream(model, keys.job_partition(held.job_id))
    job_key = keys.job(held.job_id)
    confirmed = "1" if held.start_confirmed else "0"
    entry: str | None = None
    if await run_script(redis, CLUSTER_HANDBACK_JOB_SCRIPT, [job_key], [confirmed]):
        added = await redis.xadd(stream, {JOB_ENTRY_FIELD: held.job_id})
        entry = added.decode() if isinstance(added, bytes) else str(added)
        if not await run_script(redis, CLUSTER_JOB_ENTRY_SCRIPT, [job_key], [entry]):
            await redis.xdel(stream, entry)  # the job ended meanwhile
            entry = None
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xack(stream, keys.group, held.entry_id)
        pipe.xdel(stream, held.entry_id)
        if entry is not None:
            pipe.execute_command("PUBLISH", keys.arrivals_channel(model), entry)
        await pipe.execute()
    return entry
